"""Why a request is not served, said once for every protocol: an HTTP status, OpenAI's error type
and code, the field at fault, and how long to wait before a retry.

The pipeline and the gate raise these and import nothing of HTTP; the HTTP layer writes one in
the envelope of the protocol that was asked (appliance/http/errors.py), and a wire format writes
one that cuts a stream short in its own events."""
from __future__ import annotations


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s
        self.trace_id: str | None = None  # set when the call was traced: the error names its trace too


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
