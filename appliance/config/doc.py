"""The models.toml reference (docs/config.md), written from the settings' declarations so it cannot
drift from what the reader accepts. `appliance config docs` prints it."""

from __future__ import annotations

from typing import Any, get_args, get_origin

import msgspec
import tomlkit

from appliance.config.schema import Key, describe, keys_of, strip, to_toml
from appliance.config.settings import SECTIONS, LocalModel, UpstreamModel

INTRO = """\
# models.toml reference

Every key the appliance reads from `models.toml`. Generated from the declarations in
`appliance/config/settings.py` by `appliance config docs > docs/config.md`; `tests/test_config_doc.py` fails
when it is out of date. `appliance config check [FILE]` checks a file against the same declarations;
an error names the file and the dotted key, as in `models.toml: models[2].slots: expected an integer
between 1 and 256, got 0`.
"""

HEADINGS = {LocalModel: "[[models]]", UpstreamModel: '[[models]] with engine = "openai"'}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table_type(tp: Any) -> type | None:
    """The struct of a sub-table or an array of tables, if this key holds one."""
    tp = strip(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    if get_origin(tp) is tuple:
        item = strip(get_args(tp)[0])
        if isinstance(item, type) and issubclass(item, msgspec.Struct):
            return item
    return None


def _default(k: Key, header: str) -> str:
    if k.required:
        return "required"
    if "default_doc" in k.extra:
        return k.extra["default_doc"]
    if "default_from" in k.extra:
        return f"same as `{k.extra['default_from']}`"
    if _table_type(k.type) is not None and get_origin(strip(k.type)) is not tuple:
        return f"see {header}"
    value = k.factory() if k.factory else k.default
    if value is None:
        return "none"
    toml = to_toml(value, k.type)
    if isinstance(toml, dict):  # a table default: inline, so it fits in a cell
        inline = tomlkit.inline_table()
        inline.update(toml)
        return f"`{inline.as_string()}`"
    return f"`{tomlkit.item(toml).as_string()}`"


def _rows(cls: type, prefix: str, nested: list[tuple[str, type]]) -> list[str]:
    rows = []
    for k in keys_of(cls):
        if k.extra.get("flatten"):
            rows += _rows(strip(k.type), prefix, nested)
            continue
        sub = _table_type(k.type)
        array = get_origin(strip(k.type)) is tuple
        header = f"[[{prefix}.{k.name}]]" if array else f"[{prefix}.{k.name}]"
        if sub is not None:
            nested.append((header, sub))
        value = k.extra.get("rule") or k.extra.get("form") or describe(k.type)
        rows.append(f"| `{k.name}` | {_cell(value)} | {_cell(_default(k, header))} | {_cell(k.doc)} |")
    return rows


def _section(heading: str, cls: type, prefix: str) -> list[str]:
    nested: list[tuple[str, type]] = []
    lines = [f"## {heading}", ""]
    doc = cls.__dict__.get("__doc__")
    if doc:
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | value | default | meaning |", "|---|---|---|---|", *_rows(cls, prefix, nested), ""]
    for header, sub in nested:
        lines += _section(header, sub, header.strip("[]"))
    return lines


def render() -> str:
    lines = [INTRO]
    for section in SECTIONS:
        for cls in section.types:
            heading = HEADINGS.get(cls) or (f"[[{section.name}]]" if section.array else f"[{section.name}]")
            lines += _section(heading, cls, section.name)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
