"""Program answers, pure: a word problem answered by a short straight-line program that the
appliance evaluates, instead of a worked answer in prose. The model writes fewer tokens (measured
on the workload's word problems: the frontier's programs were right as often as its worked answers at
about 43% of their cost, docs/performance.md), and the arithmetic cannot slip.

A model's program is data, never run: `straight_line` evaluates numbers, names, arithmetic and a few
pure functions over the syntax tree, with every value and step bounded, and refuses anything else
(a loop, a call, an import, an attribute, a string). A program that is refused is no answer: the
route answers the request the usual way.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

PROMPT = ("Write a short Python program that computes the answer to the problem. Use plain variables, numbers and "
          "arithmetic only, one step per line, and assign the final number to a variable named answer. "
          "Reply with one ```python code block and nothing else.")
OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
FUNCTIONS: dict[str, Callable[..., Any]] = {"round": round, "int": int, "float": float, "abs": abs, "min": min, "max": max}
# Bounds that keep a hostile program cheap: x = x * x forty times is a number of 2**40 digits.
LARGEST = 1e18
MAX_STATEMENTS = 200
# A program longer or deeper than any worked answer is refused before it is parsed or walked: the
# parser and the walk recurse, and 1,200 nested minus signs overflowed Python's stack.
MAX_CHARS = 20_000
MAX_DEPTH = 64
# The turns a program request leaves out: they set the answer's form (prose), which the program prompt replaces.
FORM_ROLES = ("system", "developer")
_EQUATION = re.compile(r"^(?P<indent>[ \t]*)(?P<left>[^=\n#]*[^=\n#\w\s][^=\n#]*?)[ \t]*=[ \t]*-?[\d.,]+[ \t]*$", re.M)
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


class NotStraightLine(Exception):
    """Why a program is not evaluated: one line."""


def program_of(reply: str) -> str:
    """The reply's first fenced block, or the reply itself."""
    found = _FENCED.search(reply)
    return found.group(1) if found else reply


def _bounded(number: Any) -> Any:
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise NotStraightLine("not a number")
    if not math.isfinite(number) or abs(number) > LARGEST:
        raise NotStraightLine("a number out of range")
    return number


def _first_line(node: ast.AST) -> str:
    """A step as a reason names it: its first line, cut short (a reason is one line)."""
    return ast.unparse(node).splitlines()[0][:40]


def _depth(tree: ast.AST) -> int:
    """How deep the tree nests, walked without recursion (a hostile tree may be deeper than the stack)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def straight_line(code: str) -> float:
    """The value of `answer`, else of the last step that gives one (an assignment, a `print(x)`, a
    bare expression), after `code`'s steps; or NotStraightLine for anything else, the evaluator's
    own failures included: a program that cannot be evaluated is no answer, never a server error."""
    if len(code) > MAX_CHARS:
        raise NotStraightLine(f"longer than {MAX_CHARS} characters")
    try:
        return _evaluate(code)
    except NotStraightLine:
        raise
    except Exception as exc:  # RecursionError, MemoryError: whatever the bounds above did not foresee
        raise NotStraightLine(f"could not be evaluated: {type(exc).__name__}") from None


def _parse(code: str) -> ast.Module:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError) as exc:  # ValueError: a null byte
        try:  # a chain of worked equations ("52 - 4 = 48"): each left side is the step, computed here
            return ast.parse(_EQUATION.sub(r"\g<indent>\g<left>", code))
        except (SyntaxError, ValueError):
            raise NotStraightLine(f"not Python: {getattr(exc, 'msg', exc)}") from exc


def _evaluate(code: str) -> float:
    tree = _parse(code)
    if len(tree.body) > MAX_STATEMENTS:
        raise NotStraightLine(f"more than {MAX_STATEMENTS} steps")
    if _depth(tree) > MAX_DEPTH:
        raise NotStraightLine(f"nested more than {MAX_DEPTH} deep")
    names: dict[str, Any] = {}

    def value(node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return _bounded(node.value)
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or (left == 0 and right < 0)):
                raise NotStraightLine("a power out of range")
            try:
                return _bounded(OPERATORS[type(node.op)](left, right))
            except (ArithmeticError, ValueError) as exc:
                raise NotStraightLine(f"{type(exc).__name__}: {exc}") from exc
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS and not node.keywords
                and 0 < len(node.args) <= 16):
            try:
                return _bounded(FUNCTIONS[node.func.id](*(value(a) for a in node.args)))
            except (TypeError, ValueError, OverflowError) as exc:
                raise NotStraightLine(f"{node.func.id}: {exc}") from exc
        raise NotStraightLine(f"not arithmetic: {_first_line(node)}")

    last = None  # the value of the last step that gave one
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
            last = value(statement.value)
            names.update({t.id: last for t in statement.targets if isinstance(t, ast.Name)})
        elif isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name) and type(statement.op) in OPERATORS:
            names[statement.target.id] = last = value(ast.BinOp(ast.Name(statement.target.id, ast.Load()), statement.op, statement.value))
        elif (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) and isinstance(statement.value.func, ast.Name)
              and statement.value.func.id == "print" and len(statement.value.args) == 1 and not statement.value.keywords):
            last = value(statement.value.args[0])
        elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str):
            continue  # a docstring
        elif isinstance(statement, ast.Expr):
            last = value(statement.value)  # a bare expression: its value, as an interpreter's prompt shows it
        else:
            raise NotStraightLine(f"not a straight-line step: {_first_line(statement)}")
    found = names.get("answer", last)
    if found is None:
        raise NotStraightLine("no step gives a number")
    return float(found)


def number_text(number: float) -> str:
    """A whole number without a decimal point; others to ten significant digits."""
    return str(int(number)) if number == int(number) else f"{number:.10g}"


def reply(program: str, number: float) -> str:
    """What the caller reads: the program as the working, then the number on an `Answer:` line."""
    return f"```python\n{program.strip()}\n```\nAnswer: {number_text(number)}"


def wants_program(program_families: tuple[str, ...], metadata: dict[str, str] | None, plain_text: bool) -> bool:
    """A request is answered by a program when the route lists its family and it asks for plain text
    (no tools, no JSON form: a program's answer fits neither). The family only changes the form of
    the answer, never the tier, so a caller naming it buys nothing."""
    family = (metadata or {}).get("family")
    return plain_text and family is not None and family in program_families
