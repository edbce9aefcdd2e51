"""The last check on a GBNF grammar before llama.cpp parses it. llama.cpp's grammar parser recurses
once per nested parenthesis and has no depth limit of its own: a grammar nested about 18,700 deep
overflows an 8 MiB thread stack (about 2,300 on a 1 MiB one) and the process dies with SIGSEGV.
A JSON Schema's `maxLength: 30000` becomes exactly such a grammar. Pure: the text in, a reason out."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarLimits:
    # The deepest a converted schema within appliance/prompt/schema_bounds.py's limits goes is about 1,000
    # (a maxLength of 1,000), and llama.cpp refuses a deeper chain of optional items on its own.
    depth: int = 1_100
    # A grammar's compile time and memory grow with its text; 128 KiB compiles in a few milliseconds.
    chars: int = 131_072


GRAMMAR_LIMITS = GrammarLimits()

# Literals and character classes (their brackets and quotes are text, not structure), or a parenthesis.
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[()]')
# The escapes llama.cpp's parser reads in literals and classes (parse_char); any other fails the whole
# grammar. The converter copies a pattern's \d or \w through, so it is named here, before any work.
_UNKNOWN_ESCAPE = re.compile(r'\\[^xuUtrn\\"\[\]-]')


def grammar_depth(text: str) -> int:
    """The deepest nesting of parentheses outside literals and character classes."""
    return _scan(text)[0]


def _scan(text: str) -> tuple[int, str | None]:
    """The deepest nesting of parentheses, and the first escape llama.cpp cannot read, if any."""
    depth = deepest = 0
    unknown = None
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth -= 1
        elif unknown is None and "\\" in token:
            bad = _UNKNOWN_ESCAPE.search(token.replace("\\\\", ""))
            unknown = bad.group() if bad is not None else None
    return deepest, unknown


def grammar_problem(text: str, limits: GrammarLimits = GRAMMAR_LIMITS) -> str | None:
    """Why llama.cpp must not be given this grammar, or None."""
    if len(text) > limits.chars:
        return f"the grammar it needs is {len(text):,} characters long, more than the {limits.chars:,} this server compiles"
    depth, unknown = _scan(text)
    if depth > limits.depth:
        return f"the grammar it needs nests {depth:,} levels deep, more than the {limits.depth:,} this server compiles"
    if unknown is not None:
        return (f"the grammar it needs has the escape {unknown}, which llama.cpp's grammars do not read "
                "(in a pattern, write [0-9] for \\d, [A-Za-z0-9_] for \\w, [ \\t\\n] for \\s)")
    return None
