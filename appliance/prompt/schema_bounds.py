"""What a caller's JSON Schema may ask a grammar for, checked before any grammar is built.

A schema is turned into a GBNF grammar (llama-cpp-python's converter) that llama.cpp compiles and
then runs over the whole vocabulary at every token. Each keyword below grows that work: a
`maxLength` or `maxItems` becomes a chain of optional items nested as deep as the number (30,000
crashed the process), each enum value or object property is one more alternative that every token
is checked against, and a pattern whose pieces can split the same text in several ways makes
llama.cpp keep every split (`(a?){0,100}` took seconds a token). The limits keep the grammar small,
its compile in milliseconds and a token's check near that of a plain grammar; docs/api.md lists
them with what they cost. One function serves every field that takes a schema (`response_format`,
Responses' `text.format`, a tool's `parameters`), validity included, so a schema is judged the same
wherever it is sent. Pure: values in, a problem or None out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from re import _constants as sre  # the stdlib's own regex parser: it knows each repetition's item and width
from re import _parser as sre_parse
from typing import Any

import jsonschema
from llama_cpp.llama_grammar import json_schema_to_gbnf

from engines.grammar_bounds import grammar_problem


@dataclass(frozen=True)
class SchemaLimits:
    repetitions: int = 1_000  # minLength, maxLength, minItems, maxItems, and a pattern's {m,n}
    enum_values: int = 500  # enum values and consts, over the whole schema
    enum_chars: int = 10_000  # their JSON text, over the whole schema
    properties: int = 128  # object properties, over the whole schema
    subschemas: int = 256  # schemas in the schema, the root included
    depth: int = 16  # schemas nested in schemas, the root being 1
    schema_chars: int = 131_072  # the schema as JSON
    pattern_chars: int = 500  # one `pattern`
    pattern_quantifiers: int = 16  # one pattern's ?, *, + and {m,n} with m < n


SCHEMA_LIMITS = SchemaLimits()
# A request's tools together: each tool is held to SCHEMA_LIMITS, and the lot to these totals (a
# required call's grammar holds them all, and checking them costs about 0.5 ms a schema).
TOOLS_LIMITS = replace(SCHEMA_LIMITS, enum_values=1_000, enum_chars=20_000, properties=512, subschemas=1_024,
                       depth=SCHEMA_LIMITS.depth + 1, schema_chars=262_144)


@dataclass(frozen=True)
class SchemaProblem:
    where: str  # a JSON pointer into the schema; "" is the root
    keyword: str
    reason: str

    def __str__(self) -> str:
        return f"'{self.keyword}' at {self.where or '/'}: {self.reason}"


# Where JSON Schema keeps subschemas: one, a list of them, or a map of them.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_REPETITIONS = ("minLength", "maxLength", "minItems", "maxItems")


def schema_problem(schema: Any, limits: SchemaLimits = SCHEMA_LIMITS) -> SchemaProblem | None:
    """The first bound the schema passes or the first way it is not a valid JSON Schema, or None.
    Bounds come first, so a hostile schema costs no more than its size."""
    return bounds_problem(schema, limits) or validity_problem(schema)


def validity_problem(schema: Any) -> SchemaProblem | None:
    """How the schema fails its metaschema (a `pattern` that is no regular expression included), or
    None. About 0.5 ms a subschema: run it after the bounds."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return SchemaProblem(_pointer(exc.absolute_path), str(exc.validator), f"not a valid JSON Schema: {exc.message}")
    return None


def bounds_problem(schema: Any, limits: SchemaLimits = SCHEMA_LIMITS) -> SchemaProblem | None:
    """The first bound the schema passes, or None; walked without recursion."""
    try:
        return _bounds_problem(schema, limits)
    except RecursionError:  # json.dumps of a const nested thousands deep (a request body is held to 64 levels first)
        return SchemaProblem("", "schema", f"it nests deeper than the {limits.depth} levels this server takes")


def _bounds_problem(schema: Any, limits: SchemaLimits) -> SchemaProblem | None:
    counts = {"subschemas": 0, "enum_values": 0, "enum_chars": 0, "properties": 0}
    stack: list[tuple[Any, str, int]] = [(schema, "", 1)]
    while stack:
        node, where, depth = stack.pop()
        if not isinstance(node, dict):
            continue  # true and false are schemas; anything else is for the validity check below
        counts["subschemas"] += 1
        if depth > limits.depth:
            return SchemaProblem(where, "schema", f"schemas nest {depth} deep here, more than the {limits.depth} this server takes")
        if counts["subschemas"] > limits.subschemas:
            return SchemaProblem(where, "schema", f"the schema holds more than {limits.subschemas} schemas")
        problem = _node_problem(node, where, counts, limits)
        if problem is not None:
            return problem
        stack.extend(reversed(_children(node, where, depth + 1)))
    size = len(json.dumps(schema))  # descriptions and unknown keywords too: all of it is checked and carried
    if size > limits.schema_chars:
        return SchemaProblem("", "schema", f"it is {size:,} characters of JSON, more than the {limits.schema_chars:,} this server takes")
    return None


def schema_grammar(schema: dict[str, Any]) -> str:
    """The GBNF grammar for a schema that passed `schema_problem`, refused (ValueError) when what
    the converter wrote is larger or deeper than llama.cpp may be given."""
    grammar = json_schema_to_gbnf(json.dumps(schema))
    problem = grammar_problem(grammar)
    if problem is not None:
        raise ValueError(problem)
    return grammar


def _node_problem(node: dict[str, Any], where: str, counts: dict[str, int], limits: SchemaLimits) -> SchemaProblem | None:
    for keyword in _REPETITIONS:
        value = node.get(keyword)
        if _number(value) and value > limits.repetitions:
            return SchemaProblem(f"{where}/{keyword}", keyword, f"{value:,} is more than the {limits.repetitions:,} this server enforces")
    values = list(node["enum"]) if isinstance(node.get("enum"), list) else []
    values += [node["const"]] if "const" in node else []
    if values:
        counts["enum_values"] += len(values)
        keyword = "enum" if "enum" in node else "const"
        if counts["enum_values"] > limits.enum_values:
            return SchemaProblem(f"{where}/{keyword}", keyword, f"the schema's enum and const values number more than {limits.enum_values}")
        counts["enum_chars"] += sum(len(json.dumps(v)) for v in values)
        if counts["enum_chars"] > limits.enum_chars:
            return SchemaProblem(f"{where}/{keyword}", keyword,
                                 f"the schema's enum and const values are more than {limits.enum_chars:,} characters of JSON")
    if isinstance(node.get("properties"), dict):
        counts["properties"] += len(node["properties"])
        if counts["properties"] > limits.properties:
            return SchemaProblem(f"{where}/properties", "properties", f"the schema has more than {limits.properties} properties")
    if isinstance(node.get("pattern"), str):
        reason = pattern_problem(node["pattern"], limits)
        if reason is not None:
            return SchemaProblem(f"{where}/pattern", "pattern", reason)
    return None


def pattern_problem(pattern: str, limits: SchemaLimits = SCHEMA_LIMITS) -> str | None:
    """Why a `pattern` is refused: too long, not a regular expression, a count past the limit, or
    a shape llama.cpp's grammars cannot follow at a bounded cost."""
    if len(pattern) > limits.pattern_chars:
        return f"it is {len(pattern):,} characters long, more than the {limits.pattern_chars} this server takes"
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return f"{pattern!r} is not a valid regular expression ({exc})"
    open_quantifiers = 0
    stack: list[Any] = [parsed]
    while stack:
        for op, av in stack.pop():
            if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
                low, high, item = av
                bounded = high != sre.MAXREPEAT
                if low > limits.repetitions or (bounded and high > limits.repetitions):
                    return f"a repetition count of {high if bounded else low:,} is more than the {limits.repetitions:,} this server enforces"
                open_quantifiers += low != high
                if open_quantifiers > limits.pattern_quantifiers:
                    return f"it has more than {limits.pattern_quantifiers} quantifiers (?, *, +, {{m,n}})"
                # Counted copies of an item that can match different lengths can split the text in
                # combinatorially many ways, and llama.cpp's grammar follows every one of them.
                width = item.getwidth()
                if (low > 1 or (bounded and high > 1)) and (width[0] != width[1] or width[0] == 0):
                    return "a counted repetition ({m}, {m,n}, {m,}) must repeat something of one fixed, non-zero length"
                stack.append(item)
            elif op is sre.SUBPATTERN:
                stack.append(av[3])
            elif op is sre.BRANCH:
                stack.extend(av[1])
            elif op in (sre.ASSERT, sre.ASSERT_NOT):
                stack.append(av[1])
            elif op is sre.GROUPREF_EXISTS:
                stack.extend(branch for branch in av[1:] if branch is not None)
    return None


def _children(node: dict[str, Any], where: str, depth: int) -> list[tuple[Any, str, int]]:
    out: list[tuple[Any, str, int]] = []
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out.append((node[key], f"{where}/{key}", depth))
    for key in _LISTS:
        if isinstance(node.get(key), list):
            out += [(sub, f"{where}/{key}/{i}", depth) for i, sub in enumerate(node[key])]
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            out += [(sub, f"{where}/{key}/{_escape(name)}", depth) for name, sub in node[key].items()]
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _pointer(path: Any) -> str:
    return "".join(f"/{_escape(str(part))}" for part in path)
