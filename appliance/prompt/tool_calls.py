"""Tool calling's pure parts: the tools a request offers, how a model writes a call, reading calls
back out of its text (whole or as it streams), and the grammar that forces one.

Two written forms are understood:
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
  Qwen2.5's own template asks for it, and it is the generic form this server teaches, in a system
  message, to models whose templates know nothing of tools.
- "llama": the whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.x), optionally after
  `<|python_tag|>`.
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral's v3 to v7 tokenizers:
  Mistral 7B v0.3, Nemo, Small 3.1), after any text.
- "mistral_args": `[TOOL_CALLS]name[ARGS]{...}`, once per call (the v11+ tokenizers: Mistral Small
  3.2, Magistral, Devstral). Either Mistral form is read in both.
- "harmony": gpt-oss's call on its commentary channel, after its reasoning:
  `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, the
  recipient in the channel's header or the role's, `<|constrain|>json` or ` json` or neither. The model
  stops at `<|call|>` (an end of generation), so one call ends the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from appliance.prompt.reasoning import writes_channels
from appliance.prompt.schema_bounds import schema_grammar

Format = Literal["hermes", "llama", "mistral", "mistral_args", "harmony"]
Mode = Literal["auto", "required", "none"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL = ("mistral", "mistral_args")
_NAME = re.compile(r"\s*([A-Za-z0-9_.:-]{1,128})\[ARGS\]")
FENCE = "```"
# A whole answer that is one fenced JSON object: how Qwen2.5-Coder writes a call when the prompt is long.
_FENCED = re.compile(r"```(?:json)?[ \t]*\n(\{.*\})\s*```", re.S)
# gpt-oss's call header, up to where the arguments start; held from its first marker while streaming. The
# whitespace runs are possessive: as plain `\s*` around optional parts, a run of spaces cost O(n^4) tries.
_HARMONY_CALL = re.compile(r"(?:<\|end\|>)?(?:<\|start\|>assistant\s*+)?(?:<\|channel\|>commentary\s*+)?to=functions\.([A-Za-z0-9_.:-]{1,128})"
                           r"\s*+(?:<\|channel\|>commentary)?\s*+(?:<\|constrain\|>)?\s*+(?:json)?\s*+<\|message\|>")
_HARMONY_STARTS = ("<|end|>", "<|start|>", "<|channel|>commentary", "to=functions.")
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")
# A channel's header or an end of message left in the text around a call (a preamble on the commentary channel).
_HARMONY_FRAMING = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>(?:final|commentary)<\|message\|>|<\|end\|>")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments object

    def wire(self) -> dict[str, Any]:
        """The tool as OpenAI (and Hugging Face chat templates) write it."""
        function: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of the model: which tools, whether it must call one (and which), and
    in which form this model writes calls."""

    tools: tuple[Tool, ...]
    mode: Mode = "auto"
    forced: str | None = None  # the one function tool_choice names
    parallel: bool = True
    format: Format = "hermes"

    @property
    def offered(self) -> tuple[Tool, ...]:
        if self.mode == "none":
            return ()
        return tuple(t for t in self.tools if t.name == self.forced) if self.forced else self.tools

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text that is not a call; None when the answer is calls only
    calls: tuple[ToolCall, ...] = ()
    problem: str | None = None  # why text that looks like a call is not one (the router escalates on it)


ARGUMENT_PIECE = 24  # characters of arguments per streamed delta, as OpenAI sends them in pieces


def argument_pieces(arguments: str) -> list[str]:
    """A call's arguments in the pieces a stream sends them in (clients join them)."""
    return [arguments[i:i + ARGUMENT_PIECE] for i in range(0, len(arguments), ARGUMENT_PIECE)]


def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_text(name: str, arguments: Any, fmt: Format = "hermes") -> str:
    """A call written the way the model is taught to write it (history in generic templates)."""
    if fmt == "llama":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    if fmt == "mistral":
        return TOOL_CALLS + json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)
    if fmt == "mistral_args":
        return f"{TOOL_CALLS}{name}{ARGS}{json.dumps(arguments, ensure_ascii=False)}"
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def system_prompt(tools: Sequence[Tool]) -> str:
    """The generic (Hermes-style) instructions for a model whose template ignores tools."""
    listed = "\n".join(json.dumps(t.wire(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
            f"XML tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}")


def _call(obj: Any, names: frozenset[str], make_id: Any = new_id) -> ToolCall | str:
    """A decoded call object as a ToolCall, or why it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "a call must be an object with a string 'name'"
    if obj["name"] not in names:
        return f"the model called {obj['name']!r}, which is not one of the tools"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args)
        except ValueError:
            return "the arguments are not JSON"
    if not isinstance(args, dict):
        return "the arguments are not a JSON object"
    call_id = obj.get("id") if isinstance(obj.get("id"), str) and obj["id"] else make_id()
    return ToolCall(call_id, obj["name"], json.dumps(args, ensure_ascii=False))


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a model's text nested past Python's limit is no call either
        return None


_DECODER = json.JSONDecoder()


def _raw_decode(text: str, at: int) -> tuple[Any, int]:
    """The JSON value at `at` and where it ends; ValueError where there is none, nesting past
    Python's recursion limit included (a model can be steered into writing thousands of brackets)."""
    try:
        return _DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _block_at(text: str, start: int) -> tuple[int, Any, bool] | None:
    """The call that opens with the tag at `start`: where it ends, its decoded JSON, and whether its
    close tag came; None when no whole JSON value follows the tag. The JSON's own end decides, so a
    close tag written inside a string of the arguments does not cut the call short."""
    j = start + len(OPEN)
    while j < len(text) and text[j].isspace():
        j += 1
    try:
        obj, end = _raw_decode(text, j)
    except ValueError:
        return None
    k = end
    while k < len(text) and text[k].isspace():
        k += 1
    if text.startswith(CLOSE, k):
        return k + len(CLOSE), obj, True
    return end, obj, False


def parse(text: str, plan: ToolPlan) -> Parsed:
    """The calls in a whole answer. Text that does not parse as a call stays content, with the
    reason in `problem`; with parallel calls off, only the first call counts."""
    names = plan.names
    calls: list[ToolCall] = []
    problem: str | None = None
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    fenced = _FENCED.fullmatch(body)
    if fenced is not None and OPEN not in text:  # a fenced call counts only as the whole answer; else it stays text
        found = _call(_decode(fenced.group(1)), names)
        return Parsed(None, (found,)) if isinstance(found, ToolCall) else Parsed(text)
    if body.startswith("{") and (plan.format == "llama" or OPEN not in text):
        # The llama form; and a bare JSON call, which Hermes-form models also write (Qwen2.5-Coder 0.5B does).
        found = _call(_decode(body), names)
        if isinstance(found, ToolCall):
            return Parsed(None, (found,))
        return Parsed(text, problem=found if plan.format == "llama" or '"name"' in body else None)
    if plan.format == "llama":
        return Parsed(text)
    if plan.format in _MISTRAL:
        return _parse_mistral(text, plan)
    if plan.format == "harmony":
        return _parse_harmony(text, plan)
    kept: list[str] = []
    at = pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        block = _block_at(text, start)
        if block is None:
            problem = problem or "the call is not JSON"
            close = text.find(CLOSE, start)
            pos = close + len(CLOSE) if close >= 0 else len(text)
            continue
        end, obj, _ = block
        found = _call(obj, names)
        pos = end
        if isinstance(found, str):
            problem = problem or found
            continue
        kept.append(text[at:start])
        at = end
        calls.append(found)
    if not calls:
        return Parsed(text, problem=problem)
    kept.append(text[at:])
    content = "".join(kept).strip()
    return Parsed(content or None, tuple(calls[:1] if not plan.parallel else calls), problem)


def _parse_mistral(text: str, plan: ToolPlan) -> Parsed:
    """Mistral's calls: everything after the first [TOOL_CALLS] is calls, a JSON list of them or
    `name[ARGS]{...}` (each after its own [TOOL_CALLS]); the text before it is the content."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        return Parsed(text)
    calls: list[ToolCall] = []
    problem: str | None = None
    at = start
    while text.startswith(TOOL_CALLS, at):
        at += len(TOOL_CALLS)
        while at < len(text) and text[at].isspace():
            at += 1
        named = _NAME.match(text, at)
        try:
            if named is not None:
                arguments, at = _raw_decode(text, named.end())
                objects: list[Any] = [{"name": named.group(1), "arguments": arguments}]
            else:
                decoded, at = _raw_decode(text, at)
                objects = decoded if isinstance(decoded, list) else [decoded]
        except ValueError:
            problem = problem or "the call is not JSON"
            break
        for obj in objects:
            found = _call(obj, plan.names)
            if isinstance(found, str):
                problem = problem or found
            else:
                calls.append(found)
        while at < len(text) and text[at].isspace():
            at += 1
    if not calls:
        return Parsed(text, problem=problem)
    content = (text[:start] + text[at:]).strip()
    return Parsed(content or None, tuple(calls[:1] if not plan.parallel else calls), problem)


def _parse_harmony(text: str, plan: ToolPlan) -> Parsed:
    """gpt-oss's calls: each header names the function, and its JSON arguments follow `<|message|>`;
    the text before the first is the content (any final channel's header dropped)."""
    calls: list[ToolCall] = []
    problem: str | None = None
    kept: list[str] = []
    at = 0
    while (header := _HARMONY_CALL.search(text, at)) is not None:
        try:
            arguments, end = _raw_decode(text, header.end())
        except ValueError:
            problem = problem or "the call is not JSON"
            break
        found = _call({"name": header.group(1), "arguments": arguments}, plan.names)
        if isinstance(found, str):
            problem = problem or found
        else:
            calls.append(found)
        kept.append(text[at:header.start()])
        at = end
        while at < len(text) and text[at].isspace():
            at += 1
        at += len("<|call|>") if text.startswith("<|call|>", at) else 0
    if not calls:
        return Parsed(text, problem=problem)
    content = _HARMONY_FRAMING.sub("", "".join(kept + [text[at:]])).strip()
    return Parsed(content or None, tuple(calls[:1] if not plan.parallel else calls), problem)


def answer_calls(text: str, plan: ToolPlan | None) -> tuple[str, tuple[ToolCall, ...]]:
    """A whole answer as its text and its calls, as every wire writes it: with no tools offered, or
    no call read, the text itself and none; else the text around the calls ("" when none)."""
    parsed = parse(text, plan) if plan is not None else None
    if parsed is None or not parsed.calls:
        return text, ()
    return parsed.content or "", parsed.calls


def arguments_problem(call: ToolCall, plan: ToolPlan) -> str | None:
    """Whether a call's arguments break its tool's schema (the router escalates on it)."""
    tool = next((t for t in plan.tools if t.name == call.name), None)
    if tool is None:
        return f"unknown tool {call.name!r}"
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
                                             .iter_errors(json.loads(call.arguments)))
    return None if error is None else f"arguments of {call.name}: {error.message}"


_FENCED_START = re.compile(r"```(?:json)?[ \t]*\n\s*\{")


def _may_open_fenced_call(text: str) -> bool:
    """Whether an answer's opening may still become a fenced call: held until it says (a fence,
    `json` or nothing, a line break, then `{`); a fence for code streams on at once."""
    if FENCE.startswith(text):
        return True
    if not text.startswith(FENCE) or _FENCED_START.match(text):
        return False
    rest = text[len(FENCE):]
    tag, newline, after = rest.partition("\n")
    return tag.strip() in ("", "json", "j", "js", "jso") and (not newline or not after.strip())


@dataclass
class StreamParser:
    """Reads calls out of text as it streams: text goes on at once unless it may be the start of a
    call, which is held until the call closes (or the answer ends) and then goes on as one call."""

    plan: ToolPlan
    _held: str = ""
    _in_call: bool = False
    _started: bool = False  # any non-blank text seen (a bare call must open the answer)
    _whole: bool = False  # the answer opens as a bare JSON call, so all of it is held
    _blank: str = ""  # blank text before a possible call: dropped if a call follows
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[str | ToolCall]:
        self._held += text
        if self._whole:
            return []
        if not self._started:
            # An answer that opens with JSON (or the llama form's tag) may be one bare call: held whole.
            stripped = self._held.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped) or _may_open_fenced_call(stripped):
                return []
            self._started = True
            if stripped.startswith(("{", PYTHON_TAG)) or _FENCED_START.match(stripped):
                self._whole = True
                return []
        if self.plan.format == "llama":
            out, self._held = self._held, ""
            return [out]
        if self.plan.format in _MISTRAL:
            return self._hold_from((TOOL_CALLS,))
        if self.plan.format == "harmony":
            return self._hold_from(_HARMONY_STARTS)
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                # Held until a whole JSON value and its close tag have come (or the answer ends).
                text = OPEN + self._held
                block = _block_at(text, 0)
                if block is None:
                    return out
                end, _, closed = block
                after = text[end:].lstrip()
                if not closed and (not after or CLOSE.startswith(after)):
                    return out
                self._held = text[end:]
                self._in_call = False
                out += self._block(text[:end])
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                out += self._text(self._held[:start])
                self._held = self._held[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._held, OPEN)
            out += self._text(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return out

    def _hold_from(self, markers: tuple[str, ...]) -> list[str | ToolCall]:
        """Text before the first marker goes on; from it on, everything is held and read as calls
        when the answer ends ([TOOL_CALLS] for Mistral, gpt-oss's call header)."""
        starts = [at for marker in markers if (at := self._held.find(marker)) >= 0]
        if starts:
            start = min(starts)
            out = self._text(self._held[:start])
            self._held, self._whole = self._held[start:], True
            return out
        keep = max(_partial_suffix(self._held, marker) for marker in markers)
        out = self._text(self._held[:len(self._held) - keep])
        self._held = self._held[len(self._held) - keep:]
        return out

    def _text(self, text: str) -> list[str | ToolCall]:
        # Blank text before or between calls is held: if calls follow, it is dropped.
        if not text:
            return []
        if not text.strip():
            self._blank += text
            return []
        self._started = True
        blank, self._blank = self._blank, ""
        return [blank + text]

    def _block(self, block: str) -> list[str | ToolCall]:
        parsed = parse(block, self.plan)
        if not parsed.calls:
            return self._text(block)
        if self.calls and not self.plan.parallel:
            return []
        self.calls.append(parsed.calls[0])
        self._blank = ""
        return [parsed.calls[0]]

    def end(self) -> list[str | ToolCall]:
        """What is still held when the answer ends: a cut-off call that still parses is a call."""
        held, self._held = self._held, ""
        if self._whole:
            parsed = parse(held, self.plan)
            self.calls += parsed.calls
            return list(parsed.calls) or [held]
        if self._in_call:
            self._in_call = False
            return self._block(OPEN + held)
        out = self._text(held)
        if self._blank and not self.calls:
            out.append(self._blank)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be cut mid-marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def grammar(plan: ToolPlan) -> str:
    """GBNF for exactly one call to one of the offered tools, in the model's form, with arguments
    that match the tool's schema: a forced call always parses and validates."""
    key = "parameters" if plan.format == "llama" else "arguments"
    if plan.format == "harmony":  # its call comes after its reasoning, which a grammar from the first token would skip
        raise ValueError("a forced call cannot be written in gpt-oss's channels")
    if plan.format == "mistral_args":  # name[ARGS]{arguments}: each tool's name, then its own arguments
        return _mistral_args_grammar(plan)
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, key: t.parameters},
                         "required": ["name", key]} for t in plan.offered]}
    rules = _json_strings(re.sub(r"^root ::=", "tool-call-json ::=", schema_grammar(schema), flags=re.M))
    if plan.format == "llama":
        return rules + "\nroot ::= tool-call-json\n"
    if plan.format == "mistral":
        return rules + '\nroot ::= "[TOOL_CALLS][" tool-call-json "]"\n'
    return rules + '\nroot ::= "<tool_call>\\n" tool-call-json "\\n</tool_call>"\n'


def _json_strings(rules: str) -> str:
    """The converter lets a string hold raw newlines and other control characters, which JSON forbids."""
    return rules.replace('char ::= [^"\\\\]', 'char ::= [^"\\\\\\x7F\\x00-\\x1F]')


def _mistral_args_grammar(plan: ToolPlan) -> str:
    """[TOOL_CALLS], a tool's name, [ARGS], and arguments that match that tool's schema: the tools'
    schemas as one anyOf, whose alternatives the converter names alternative-0, -1, ... in order."""
    rules = _json_strings(re.sub(r"^root ::=.*$", "", schema_grammar({"anyOf": [t.parameters for t in plan.offered]}), flags=re.M))
    choices = " | ".join(f'"{t.name}[ARGS]" alternative-{i}' for i, t in enumerate(plan.offered))
    return rules + f'\nroot ::= "[TOOL_CALLS]" ({choices})\n'


def strings(value: Any) -> Iterable[str]:
    """Every string in a JSON value, keys included: what a caller wrote into tools or calls."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for k, v in item.items():
                yield str(k)
                stack.append(v)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def marker_texts(fmt: Format) -> tuple[str, ...]:
    """The texts that mark a call in this form: where a model has them as control tokens, their
    text must reach the parser."""
    if fmt == "llama":
        return (PYTHON_TAG,)
    if fmt in _MISTRAL:
        return (TOOL_CALLS, ARGS)
    if fmt == "harmony":
        return _HARMONY_MARKERS
    return (OPEN, CLOSE)


def template_form(uses_tools: bool, source: str) -> tuple[bool, Format]:
    """Whether a chat template renders tools itself, and the form its model writes calls in. A
    template whose call form is neither known form is treated as one that ignores tools."""
    if uses_tools and writes_channels(source):
        return True, "harmony"
    if uses_tools and OPEN in source:
        return True, "hermes"
    if uses_tools and TOOL_CALLS in source:
        return True, "mistral_args" if ARGS in source else "mistral"
    if uses_tools and (PYTHON_TAG in source or '"parameters"' in source):
        return True, "llama"
    return False, "hermes"


def answer_problem(text: str, plan: ToolPlan) -> str | None:
    """Why an answer fails as a tool-calling answer (the router escalates on it): a call that does
    not parse or breaks its schema, or no call where one was required."""
    parsed = parse(text, plan)
    for call in parsed.calls:
        problem = arguments_problem(call, plan)
        if problem is not None:
            return problem
    if parsed.problem is not None and not parsed.calls:
        return parsed.problem
    if plan.mode == "required" and not parsed.calls:
        return "no tool call where one is required"
    return None
