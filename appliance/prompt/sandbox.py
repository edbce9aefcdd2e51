"""The Jinja sandbox chat templates render in, with a bound on what one render may cost.

Jinja's sandbox keeps a template from reaching Python's internals, but not from computing: a
template that evaluates `7**(4000000*len(messages))` holds the interpreter for seconds in one
multiplication, and a render thread cannot be stopped from outside. So each operation that can grow
a value past its inputs is checked before it runs (numbers by their bits, text and lists by the
length they would reach), and every loop step, call, attribute, operator and piece of output checks
the render's deadline. A render past a bound raises TemplateBoundError.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.runtime import Macro
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# One render of a chat template, at most: its time, the text it makes beyond what it was given (a
# template's own system prompt and tool instructions), and the size of any number it computes.
RENDER_SECONDS = 2.0
RENDER_BASE_CHARS = 1 << 20
RENDER_INPUT_FACTOR = 4  # times the characters of the messages and tools it renders
MAX_INT_BITS = 4096
MAX_SIZE_ARG = MAX_RANGE  # the most a width, count or repeat given to a call may be (Jinja's own range bound)
MAX_TEMPLATE_CHARS = 256 * 1024  # the largest templates in use are tens of KB


class TemplateError(ValueError):
    pass


class TemplateBoundError(TemplateError):
    """A render that went past its time or size bound."""


@dataclass(frozen=True)
class Budget:
    deadline: float  # time.monotonic()
    max_chars: int


_local = threading.local()  # the budget of the render running on this thread
_UNBOUNDED_TIME = Budget(float("inf"), RENDER_BASE_CHARS)  # compiling: constants folded, no render running


def _budget() -> Budget:
    return getattr(_local, "budget", None) or _UNBOUNDED_TIME


def tick() -> None:
    if time.monotonic() > _budget().deadline:
        raise TemplateBoundError(f"the chat template ran past its {RENDER_SECONDS:g} s bound")


def _too_big(what: str) -> TemplateBoundError:
    return TemplateBoundError(f"the chat template {what} past its bound of {_budget().max_chars:,} characters")


def _sized(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > _budget().max_chars:
        raise _too_big(f"made a {type(value).__name__} of {len(value):,} items,")
    return value


def _want(chars: int) -> None:
    """Refuses an operation that would make a value of `chars` items, before it runs."""
    if chars > _budget().max_chars:
        raise _too_big(f"asked for {chars:,} characters,")


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else len(str(value)) if isinstance(value, (int, float)) else 0


def _check_int(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateBoundError(f"the chat template computed a number of more than {MAX_INT_BITS} bits")


_FIELD = re.compile(r"%|\{")
_NUMBER = re.compile(r"\d+")


def _format_size(fmt: str, values: Iterable[Any]) -> int:
    """An upper bound on the length of `fmt % values` or `fmt.format(*values)`: each field may hold
    the widest width named anywhere (in the text or as an argument) and the longest value."""
    values = list(values)
    widths = [int(n) if len(n) < 12 else 10**12 for n in _NUMBER.findall(fmt)]
    widths += [abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
    longest = max((_length(v) for v in values), default=0)
    return len(fmt) + len(_FIELD.findall(fmt)) * (max(widths, default=0) + longest)


def _arguments(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_binop(operator: str, left: Any, right: Any) -> None:
    ints = [isinstance(v, int) and not isinstance(v, bool) for v in (left, right)]
    if operator == "**" and all(ints):
        if abs(left) > 1 and right > 0 and abs(left).bit_length() * right > MAX_INT_BITS:
            raise TemplateBoundError(f"the chat template computed a number of more than {MAX_INT_BITS} bits")
    elif operator == "*":
        if all(ints):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateBoundError(f"the chat template computed a number of more than {MAX_INT_BITS} bits")
        elif ints[1] and isinstance(left, (str, list, tuple)):
            _want(len(left) * max(right, 0))
        elif ints[0] and isinstance(right, (str, list, tuple)):
            _want(len(right) * max(left, 0))
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _want(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _want(_format_size(left, _arguments(right)))


def _check_sizes(args: Iterable[Any], kwargs: dict[str, Any]) -> None:
    """A width, count or repeat given to a method or filter (`ljust`, `center`, `indent`, `batch`)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SIZE_ARG:
            raise TemplateBoundError(f"the chat template passed {value} where a size of at most {MAX_SIZE_ARG} is allowed")


# Where the unit each piece grows by is given: (its position after the text, its keyword).
_PER_PIECE = {"indent": (0, "width"), "expandtabs": (0, "tabsize"), "wordwrap": (2, "wrapstring")}


def _expanding(name: str, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, method: bool) -> None:
    """The operations on text that can make more than they are given, a method of `subject` or a
    filter of it by their name, checked against what they would make before they run."""
    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name == "replace" and isinstance(subject, str):
        old, new = arg(0, "old", ""), arg(1, "new", "")
        if isinstance(old, str) and isinstance(new, str):
            _want(len(subject) + (subject.count(old) if old else len(subject) + 1) * len(new))
    elif name == "join":
        items, sep = (arg(0, "iterable", ()), subject) if method else (subject, arg(0, "d", ""))
        if isinstance(items, (str, list, tuple, range)):
            _want(sum(map(_length, items)) + len(items) * _length(sep))
    elif name in _PER_PIECE and isinstance(subject, str):
        unit = arg(*_PER_PIECE[name])
        per = len(unit) if isinstance(unit, str) else min(abs(unit), MAX_SIZE_ARG) if isinstance(unit, int) else 8
        pieces = len(subject) + 1 if name == "wordwrap" else subject.count("\n" if name == "indent" else "\t") + 1
        _want(len(subject) + pieces * per)
    elif name in ("format", "format_map") and isinstance(subject, str):
        _want(_format_size(subject, [*args, *kwargs.values(), *(v for a in args if isinstance(a, dict) for v in a.values())]))
    elif name == "sum" and not method and not isinstance(arg(1, "start", 0), (int, float)):
        raise TemplateBoundError("the chat template sums something other than numbers")  # lists or text: time growing with the square


def bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that checks the deadline and its arguments' sizes before it runs and its result's after."""
    passes = getattr(function, "jinja_pass_arg", None) is not None  # the environment or context comes first

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        tick()
        given = args[1:] if passes else args
        if given:
            given = (_listed(given[0]) if name == "join" else given[0], *given[1:])
            _check_sizes(given[1:], kwargs)
            _expanding(name, given[0], tuple(given[1:]), kwargs, method=False)
            args = (*args[:1], *given) if passes else given
        return _sized(function(*args, **kwargs))

    return run


def _listed(value: Any) -> Any:
    """A generator (from `map` or `select`) as a list, so what joining it makes can be counted first."""
    return list(_loop_over(value)) if isinstance(value, Iterator) else value


def _join(items: Iterable[Any]) -> str:
    """What a macro's, a block's or `~`'s pieces make, joined once their length is known to fit."""
    pieces = [p if isinstance(p, str) else str(p) for p in items]
    _want(sum(map(len, pieces)))
    return "".join(pieces)


def _loop_over(iterable: Any) -> Iterator[Any]:
    for i, item in enumerate(iterable):
        if not i & 63:
            tick()
        yield item


class _Bounding(NodeTransformer):
    """Routes what the sandbox does not intercept through the environment: every for loop's
    iterable (nested loops grow with the product of their lengths) and `~` (text joined)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("loop_over", lineno=node.lineno), [node.iter], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        joined = nodes.Tuple(node.nodes, "load", lineno=node.lineno)
        return nodes.Call(nodes.EnvironmentAttribute("join_text", lineno=node.lineno), [joined], [], None, None, lineno=node.lineno)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    concat = staticmethod(_join)  # the buffers of macros, blocks and filter sections
    loop_over = staticmethod(_loop_over)
    join_text = staticmethod(_join)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # text made to measure: no template needs it
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateBoundError(f"the chat template has {len(source):,} characters, more than its bound of {MAX_TEMPLATE_CHARS:,}")
        tree = _Bounding().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tick()
        _check_binop(operator, left, right)
        result = self.binop_table[operator](left, right)
        _check_int(result)
        return _sized(result)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format and format_map, sandboxed by Jinja, and checked for what they would make."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text, name = value.__self__, value.__name__

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> str:
            _expanding(name, text, args, kwargs, method=True)
            return _sized(wrapped(*args, **kwargs))

        return checked

    def getattr(self, obj: Any, attribute: str) -> Any:
        tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (the sandbox's own signature)
        tick()
        if not isinstance(__obj, Macro):  # a macro's arguments are the template's values, not sizes
            name = getattr(__obj, "__name__", "")
            if name == "join" and args:
                args = (_listed(args[0]), *args[1:])
            _check_sizes(args, kwargs)
            _expanding(name, getattr(__obj, "__self__", None), args, kwargs, method=True)
        return _sized(super().call(__context, __obj, *args, **kwargs))


def within(budget: Budget, chunks: Iterable[str]) -> str:
    """The render's pieces joined, with `budget` in force on this thread while they are made."""
    previous = getattr(_local, "budget", None)
    _local.budget = budget
    try:
        out: list[str] = []
        total = 0
        for chunk in chunks:
            total += len(chunk)
            if total > budget.max_chars:
                raise _too_big(f"wrote {total:,} characters,")
            out.append(chunk)
            tick()
        return "".join(out)
    finally:
        _local.budget = previous
