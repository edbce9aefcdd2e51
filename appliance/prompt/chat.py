"""Chat messages to prompt tokens, with callers' text kept as text.

A chat template joins the turns with the model's control tokens (`<|im_start|>`, `<|eot_id|>` ...).
Tokenizing the rendered prompt with control tokens parsed would also parse them inside a caller's
message, and `<|im_end|>\\n<|im_start|>system` typed by a user would become a real system turn. So
the template is rendered once with a unique marker in place of each message's text: control tokens
are read only from the template's own text, and each message's text is tokenized as plain text
together with the plain text around it, as llama.cpp itself splits a prompt at control tokens.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.prompt.template import ChatTemplate, TemplateError
from appliance.prompt.tool_calls import strings

if TYPE_CHECKING:
    from engines.vocabulary import Vocabulary

Tokenize = Callable[[str], list[int]]  # plain text to tokens, control tokens never parsed


@dataclass(frozen=True)
class Piece:
    text: str
    control: bool  # a control token written by the template; else plain text


def pieces(rendered: str, spans: Sequence[tuple[int, int]], controls: Sequence[str]) -> list[Piece]:
    """Split the rendered prompt at the control tokens that lie wholly in the template's own text
    (outside every caller span), longest first where two start at one place; what lies between,
    callers' text included, is plain text."""
    out: list[Piece] = []
    if not controls:
        return [Piece(rendered, False)] if rendered else []
    pattern = re.compile("|".join(re.escape(c) for c in sorted(set(controls), key=len, reverse=True)))
    plain_from = 0
    cursor = 0
    bounds = sorted(spans) + [(len(rendered), len(rendered))]
    for start, end in bounds:
        for match in pattern.finditer(rendered, cursor, start):
            if match.start() > plain_from:
                out.append(Piece(rendered[plain_from:match.start()], False))
            out.append(Piece(match.group(), True))
            plain_from = match.end()
        cursor = end
    if plain_from < len(rendered):
        out.append(Piece(rendered[plain_from:], False))
    return out


def control_text(value: Any, controls: Iterable[str]) -> str | None:
    """The first control token written inside a JSON value (tools, tool calls), or None. The
    template renders such values as they are, outside the marked message text, so they are refused
    rather than let a caller's text become a control token."""
    found = [c for c in controls for text in strings(value) if c in text]
    return found[0] if found else None


def render_marked(template: ChatTemplate, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]] | None:
    """The prompt text and where each message's text lies in it; None when the template changes a
    message's text (trims it, splits it) so that its place cannot be known."""
    nonce = uuid.uuid4().hex
    marks: dict[str, str] = {}
    marked = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and content:
            mark = f"\u27e6{nonce}.{i}\u27e7"
            marks[mark] = content
            marked.append({**message, "content": mark})
        else:
            marked.append(dict(message))
    skeleton = template.render(marked, tools=tools)
    found = re.findall(f"\u27e6{nonce}\\.\\d+\u27e7", skeleton)
    if sorted(found) != sorted(marks) or len(found) != len(set(found)):
        return None
    text: list[str] = []
    spans: list[tuple[int, int]] = []
    at = 0
    length = 0
    for match in re.finditer(f"\u27e6{nonce}\\.\\d+\u27e7", skeleton):
        before = skeleton[at:match.start()]
        text.append(before)
        length += len(before)
        content = marks[match.group()]
        spans.append((length, length + len(content)))
        text.append(content)
        length += len(content)
        at = match.end()
    text.append(skeleton[at:])
    return "".join(text), spans


def render_prompt(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], controls: Iterable[str],
                  tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered prompt and where each message's text lies in it (no places where the template
    changes message text). It needs no tokenizer, so it may run on any thread. `tools` go to
    templates that render them; they and messages' tool calls must hold no control-token text."""
    structured = [tools or [], [m.get("tool_calls") or [] for m in messages]]
    inside_tools = control_text(structured, controls)
    if inside_tools is not None:
        raise TemplateError(f"a tool or tool call contains the control token {inside_tools!r}")
    marked = render_marked(template, messages, tools)
    if marked is not None:
        return marked
    text = template.render(list(messages), tools=tools)
    inside = [c for m in messages if isinstance(m.get("content"), str) for c in controls if c in m["content"]]
    if inside:
        raise TemplateError(f"a message contains the control token {inside[0]!r}, and this model's chat template changes "
                            "message text so it cannot be kept apart from the template's own tokens")
    return text, []


def prompt_tokens(text: str, spans: Sequence[tuple[int, int]], controls: Mapping[str, int], tokenize: Tokenize,
                  bos: Sequence[int]) -> list[int]:
    """`bos` (the tokenizer's start, if it adds one), then the template's control tokens by id and
    every other piece tokenized as plain text."""
    tokens = list(bos)
    for piece in pieces(text, spans, list(controls)):
        tokens += [controls[piece.text]] if piece.control else tokenize(piece.text)
    return tokens


def chat_prompt(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], controls: Mapping[str, int],
                tokenize: Tokenize, bos: Sequence[int], tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[int]]:
    """The rendered prompt and its tokens."""
    text, spans = render_prompt(template, messages, controls, tools)
    return text, prompt_tokens(text, spans, controls, tokenize, bos)


def vocabulary_tokens(vocabulary: Vocabulary, text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
    """prompt_tokens with a model's own vocabulary."""
    bos = vocabulary.tokenize("", add_special=vocabulary.add_bos(), parse_special=False)
    return prompt_tokens(text, spans, vocabulary.control_tokens(), lambda t: vocabulary.tokenize(t, add_special=False, parse_special=False), bos)


def vocabulary_prompt(template: ChatTemplate, vocabulary: Vocabulary, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[int]]:
    """chat_prompt with a model's own vocabulary (an engine, or a file's vocabulary alone): what
    serving sends the model, and what training teaches it to answer."""
    text, spans = render_prompt(template, messages, vocabulary.control_tokens(), tools)
    return text, vocabulary_tokens(vocabulary, text, spans)
