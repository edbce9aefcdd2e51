"""A request body from JSON bytes to its struct (appliance/wire/schemas.py, or an admin route's
own), decoded and type-checked in one pass by msgspec: a bad field is a 400 that names it as
OpenAI's `param`, and a body nested deeper than any OpenAI body is refused before anything
recurses on it."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from appliance.pipeline.errors import APIError, invalid

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


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """msgspec says where it failed (`$.messages[0].role`); that path is OpenAI's `param`."""
    text = str(exc)
    match = _PATH.search(text)
    param = match.group(1) if match else None
    message = _PATH.sub("", text)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return invalid(f"The request body is not valid JSON: {message}", code="invalid_json")
    if param:
        message = f"Invalid value for '{param}': {message}"
    return invalid(message, param=param)
