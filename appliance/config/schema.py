"""Settings declared once. Each key of models.toml is a field of a frozen msgspec Struct: its type,
its default, its bounds and a one-line description (`Annotated[int, Meta(ge=1, description=...)]`).
From that one declaration this module reads a TOML table into the struct, turns a value back into
TOML for the writer, and describes each key for the reference (docs/config.md).

A field's `Meta(extra=...)` may add what a type cannot say:
  rule          the words for what the key takes, in errors and the reference ("64 hexadecimal digits")
  default_from  a sibling key whose value is the default (kv_cache_type_k defaults to kv_cache_type)
  default_doc   the default in words, where it is computed (threads: the CPU count)
  load          (text, key, where) -> value: the key names something to read, such as a file
  form          the words for a `load` key's value
  flatten       a nested struct whose keys sit in the parent's table
  file          what else than a path the key may name a file as, which the admin API confines as it
                confines paths: "template" (a file unless it is template text), "package", "hub"

Every number is declared with both bounds (`ge` and `le`): what llama.cpp and the machine can take.

Every error is one line naming the file and the dotted key (`models.toml: models[2].slots: ...`).
"""

from __future__ import annotations

import math
import os
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec


class ConfigError(ValueError):
    """A problem in a config file; `str()` is the one-line message shown to the user."""

    def __init__(self, file: str, key: str, problem: str) -> None:
        self.file, self.key, self.problem = file, key, problem
        super().__init__(f"{file}: {key}: {problem}")


@dataclass(frozen=True)
class Where:
    """The file being read, and the folder its relative paths start from."""

    file: str
    base: Path

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.file, key, problem)


@dataclass(frozen=True)
class Key:
    """One declared key, as the reader, the writer and the reference see it."""

    name: str
    type: Any  # the annotation, Annotated and all
    default: Any  # msgspec.NODEFAULT: required, or made by `factory`
    factory: Callable[[], Any] | None
    doc: str
    extra: Mapping[str, Any]

    @property
    def required(self) -> bool:
        return self.default is msgspec.NODEFAULT and self.factory is None


class _Mismatch(Exception):
    """A value of the wrong form; the field it belongs to turns it into a ConfigError."""


def dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _metas(tp: Any) -> tuple[msgspec.Meta, ...]:
    """The Meta of a field's annotation, looking through `X | None`."""
    if get_origin(tp) is Annotated:
        inner, *rest = get_args(tp)
        return tuple(m for m in rest if isinstance(m, msgspec.Meta)) + _metas(inner)
    if _is_union(tp):
        members = [a for a in get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _metas(members[0])
    return ()


@cache
def keys_of(cls: type) -> tuple[Key, ...]:
    out = []
    for f in msgspec.structs.fields(cls):
        metas = _metas(f.type)
        extra: dict[str, Any] = {}
        for m in metas:
            extra |= m.extra or {}
        doc = next((m.description for m in reversed(metas) if m.description), "")  # the outermost: Alias's own yields to the field's
        factory = None if f.default_factory is msgspec.NODEFAULT else f.default_factory
        out.append(Key(f.name, f.type, f.default, factory, doc, extra))
    return tuple(out)


@cache
def table_keys(cls: type) -> frozenset[str]:
    """The keys a table of this struct may hold, a flattened struct's included."""
    names: set[str] = set()
    for k in keys_of(cls):
        names |= table_keys(strip(k.type)) if k.extra.get("flatten") else {k.name}
    return frozenset(names)


def strip(tp: Any) -> Any:
    """The type without Annotated and without `| None`."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif _is_union(tp) and len(members := [a for a in get_args(tp) if a is not type(None)]) == 1:
            tp = members[0]
        else:
            return tp


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _bounds(metas: tuple[msgspec.Meta, ...]) -> tuple[Any, Any]:
    if any(m.gt is not None or m.lt is not None for m in metas):
        raise TypeError("declare bounds with ge and le: the reader and the reference say them as inclusive")
    low = next((m.ge for m in metas if m.ge is not None), None)
    high = next((m.le for m in metas if m.le is not None), None)
    return low, high


def _bound_words(low: Any, high: Any) -> str:
    if low is not None and high is not None:
        return f" between {low} and {high}"
    if low is not None:
        return f" at least {low}"
    return f" at most {high}" if high is not None else ""


def describe(tp: Any, metas: tuple[msgspec.Meta, ...] = ()) -> str:
    """What a value of this type looks like, in words (errors and the reference)."""
    if get_origin(tp) is Annotated:
        inner, *rest = get_args(tp)
        return describe(inner, metas + tuple(m for m in rest if isinstance(m, msgspec.Meta)))
    if _is_union(tp):
        return " or ".join(describe(a) for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        return f'"{choices[0]}"' if len(choices) == 1 else f"one of {', '.join(map(str, choices))}"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer" + _bound_words(*_bounds(metas))
    if tp is float:
        return "a number" + _bound_words(*_bounds(metas))
    if tp is str:
        return "text"
    if tp is Path:
        return "a path (relative to this file)"
    if hasattr(tp, "FORM"):
        return tp.FORM
    if _is_struct(tp):
        return "a table"
    if get_origin(tp) is tuple:
        item = get_args(tp)[0]
        if _is_struct(strip(item)):
            return "an array of tables"
        if get_origin(item) is tuple:
            return f"a table of name = {describe(get_args(item)[1])}"
        return f"a list of {describe(item)}"
    raise TypeError(f"no description for {tp!r}")


def _check(value: Any, tp: Any, key: str, where: Where, metas: tuple[msgspec.Meta, ...] = ()) -> Any:
    """`value` as `tp`; a value of the wrong form raises _Mismatch, one inside a nested table a ConfigError."""
    if get_origin(tp) is Annotated:
        inner, *rest = get_args(tp)
        return _check(value, inner, key, where, metas + tuple(m for m in rest if isinstance(m, msgspec.Meta)))
    if _is_union(tp):
        members = [a for a in get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _check(value, members[0], key, where, metas)
        for member in members:
            try:
                return _check(value, member, key, where)
            except _Mismatch:
                pass
        raise _Mismatch(f"expected {describe(tp)}, got {value!r}")
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if all(isinstance(c, str) for c in choices) and (not isinstance(value, str) or not value.strip()):
            raise _Mismatch(f"expected a non-empty string, got {value!r}")
        if value not in choices:
            raise _Mismatch(f"expected {describe(tp)}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch(f"expected true or false, got {value!r}")
        return value
    if tp in (int, float):
        what = "an integer" if tp is int else "a number"
        # TOML reads inf and nan; nan passes every comparison, so a bound alone would let it through.
        finite = not isinstance(value, float) or math.isfinite(value)
        if isinstance(value, bool) or not isinstance(value, (int,) if tp is int else (int, float)) or not finite:
            raise _Mismatch(f"expected {what}, got {value!r}")
        low, high = _bounds(metas)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _Mismatch(f"expected {what}{_bound_words(low, high)}, got {value}")
        return tp(value)
    if tp in (str, Path):
        if not isinstance(value, str) or not value.strip():
            raise _Mismatch(f"expected a non-empty string, got {value!r}")
        pattern = next((m.pattern for m in metas if m.pattern), None)
        if pattern is not None and not re.search(pattern, value):
            raise _Mismatch(f"expected text matching {pattern}, got {value!r}")
        return value if tp is str else (where.base / os.path.expanduser(value)).resolve()
    if hasattr(tp, "from_toml"):
        try:
            return tp.from_toml(value)
        except ValueError as exc:
            raise _Mismatch(str(exc)) from None
    if _is_struct(tp):
        if not isinstance(value, dict):
            raise _Mismatch(f"expected a table, got {type(value).__name__}")
        return decode(tp, value, key, where)
    if get_origin(tp) is tuple:
        return _check_tuple(value, get_args(tp)[0], key, where, metas)
    raise TypeError(f"{key}: no reader for {tp!r}")


def _check_tuple(value: Any, item: Any, key: str, where: Where, metas: tuple[msgspec.Meta, ...]) -> tuple[Any, ...]:
    if _is_struct(strip(item)):  # an array of tables: each is read with its own key
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            needed = [k.name for k in keys_of(strip(item)) if k.required]
            header = re.sub(r"\[\d+\]", "", key)
            raise _Mismatch(f"expected an array of tables: [[{header}]]" + (f" with {' and '.join(needed)}" if needed else ""))
        return tuple(decode(strip(item), t, f"{key}[{i}]", where) for i, t in enumerate(value))
    if get_origin(item) is tuple:  # name = value pairs, from a table
        if not isinstance(value, dict):
            raise _Mismatch(f"expected a table, got {type(value).__name__}")
        return tuple(sorted((name, read_value(v, get_args(item)[1], dotted(key, name), where)) for name, v in value.items()))
    least = next((m.min_length for m in metas if m.min_length is not None), 0)
    if not isinstance(value, list) or len(value) < least:
        raise _Mismatch(f"expected {'a non-empty list' if least else 'a list'} of {describe(item)}, got {value!r}")
    try:
        return tuple(_check(v, item, key, where) for v in value)
    except _Mismatch:
        raise _Mismatch(f"expected a list of {describe(item)}, got {value!r}") from None


def read_value(value: Any, tp: Any, key: str, where: Where, extra: Mapping[str, Any] | None = None) -> Any:
    """One key's value as its declared type, or a ConfigError naming the key."""
    extra = extra or {}
    try:
        if "load" in extra:
            return extra["load"](_check(value, str, key, where), key, where)
        return _check(value, tp, key, where)
    except _Mismatch as exc:
        rule = extra.get("rule")
        raise where.fail(key, f"expected {rule}, got {value!r}" if rule else str(exc)) from None


def check_known(table: Mapping[str, Any], known: frozenset[str], prefix: str, where: Where) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise where.fail(dotted(prefix, unknown[0]), f"unknown key (known keys: {', '.join(sorted(known))})")


def decode(cls: type, table: Mapping[str, Any], prefix: str, where: Where, defaults: Mapping[str, Any] | None = None) -> Any:
    """A struct from one TOML table: unknown keys refused, each key checked against its declaration,
    missing keys given their defaults. `defaults` overrides declared defaults that depend on the
    table (an embedding model's prefills_per_step)."""
    check_known(table, table_keys(cls), prefix, where)
    return _build(cls, table, prefix, where, defaults or {})


def _build(cls: type, table: Mapping[str, Any], prefix: str, where: Where, defaults: Mapping[str, Any]) -> Any:
    values: dict[str, Any] = {}
    for k in keys_of(cls):
        key = dotted(prefix, k.name)
        if k.extra.get("flatten"):
            values[k.name] = _build(strip(k.type), table, prefix, where, {})
        elif k.name in table:
            values[k.name] = read_value(table[k.name], k.type, key, where, k.extra)
        elif k.name in defaults:
            values[k.name] = defaults[k.name]
        elif "default_from" in k.extra:
            values[k.name] = values[k.extra["default_from"]]
        elif k.required:
            raise where.fail(key, f"missing: {k.doc}")
        else:
            values[k.name] = k.factory() if k.factory else k.default
    return cls(**values)


def to_toml(value: Any, tp: Any = None) -> Any:
    """A typed value as the TOML value that reads back as it (`tp`, its declared type, where known):
    paths as text, a struct as a table of the keys that differ from their defaults."""
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "to_toml"):
        return value.to_toml()
    if isinstance(value, msgspec.Struct):
        table: dict[str, Any] = {}
        for k in keys_of(type(value)):
            v = getattr(value, k.name)
            if k.extra.get("flatten"):
                table |= to_toml(v)
            elif v is not None and v != (k.factory() if k.factory else k.default):
                table[k.name] = to_toml(v, k.type)
        return table
    if isinstance(value, tuple):
        declared = strip(tp) if tp is not None else None
        if get_origin(declared) is tuple and get_origin(get_args(declared)[0]) is tuple:  # name = value pairs
            return {name: to_toml(v) for name, v in value}
        return [to_toml(v) for v in value]
    return value
