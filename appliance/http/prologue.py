"""What every API route starts with: who is calling, and the typed body."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from litestar import Request

from appliance.pipeline.errors import from_validation, invalid
from appliance.http.headers import remember_principal
from appliance.server.services import Services
from policy.identity import Principal

T = TypeVar("T")


# No OpenAI body nests this deep; a schema or tool that does is refused before anything recurses on it.
MAX_DEPTH = 64


def decode_body(body: bytes, kind: type[T]) -> T:
    if not body:
        raise invalid("The request body is empty; send a JSON object.")
    try:
        decoded = msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation(exc) from None
    except RecursionError:
        decoded = None
    if decoded is None or depth(decoded, MAX_DEPTH) > MAX_DEPTH:
        raise invalid(f"The request body nests deeper than {MAX_DEPTH} levels.", code="nested_too_deep")
    return decoded


def depth(value: Any, limit: int) -> int:
    """How deep a decoded body nests (structs, lists, dicts), counted without recursion and no
    further than limit + 1."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, msgspec.Struct):
            children: Any = (getattr(item, f) for f in item.__struct_fields__)
        elif isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


async def authenticate(request: Request[Any, Any, Any], services: Services) -> Principal:
    client = request.client.host if request.client else None
    principal = await services.gate.authenticate(request.headers.get("authorization"), client, request.url.path)
    remember_principal(request.scope, principal)  # the response's rate-limit headers are this caller's
    return principal
