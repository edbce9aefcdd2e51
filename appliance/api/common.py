"""What every API route starts with: who is calling, and the typed body."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from litestar import Request

from appliance.api.errors import from_validation, invalid
from appliance.services import Services
from policy.identity import Principal

T = TypeVar("T")


def decode_body(body: bytes, kind: type[T]) -> T:
    if not body:
        raise invalid("The request body is empty; send a JSON object.")
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation(exc) from None


async def authenticate(request: Request[Any, Any, Any], services: Services) -> Principal:
    client = request.client.host if request.client else None
    return await services.gate.authenticate(request.headers.get("authorization"), client, request.url.path)
