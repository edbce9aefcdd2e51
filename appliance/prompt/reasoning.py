"""Reasoning kept apart from the answer, for models that think before they answer (Qwen3, QwQ,
DeepSeek-R1's distills, SmolLM3, Phi-4-reasoning: `<think>…</think>` before the answer; gpt-oss:
its analysis channel before its final one).

A model's template says whether it reasons (it writes the markers) and whether a request may turn
it off (it reads `enable_thinking`, as Qwen3's and SmolLM3's do). Where the split starts is read
from each request's rendered prompt: one that ends inside an opened `<think>` (DeepSeek-R1's
templates open it) starts in the reasoning; one that ends after a closed, empty one (thinking
turned off) starts in the answer; otherwise the answer may open with one.

The split is pure: text in, (reasoning, content) out, as generated text arrives token by token;
a piece that may be the start of a marker is held until it is known."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from engines.interface import THINK_CLOSE as CLOSE, THINK_OPEN as OPEN

SWITCH = "enable_thinking"  # the template variable a request's "no reasoning" sets to false
EFFORT = "reasoning_effort"  # the template variable gpt-oss's template reads: how hard to think (low, medium, high)


@dataclass(frozen=True)
class ReasoningFormat:
    open: str
    close: str
    switchable: bool  # the template turns it off when asked
    answer_open: str = ""  # what opens an answer that has no reasoning before it (gpt-oss's final channel)
    also_close: str = ""  # a shorter closing marker, for an engine that does not write the first one's control token
    effort: bool = False  # the template reads `reasoning_effort`
    harmony: bool = False  # gpt-oss's channels: its tool calls come on a channel of their own (HARMONY_CALLS)
    # Markers that end the reasoning and are kept at the start of the answer (gpt-oss's tool call, for the
    # tool parser to read), less `end`, an end-of-message marker an engine may write before one.
    hands_on: tuple[str, ...] = ()
    end: str = ""

    @property
    def closes(self) -> tuple[str, ...]:
        return (self.close, self.also_close) if self.also_close else (self.close,)


# gpt-oss's harmony channels: its reasoning is the analysis channel, its answer the final one. llama.cpp
# writes <|channel|>, <|message|> and <|start|> as text but not <|end|> (a control token): the reasoning
# ends at either closing marker. Its template cannot turn the reasoning off; it reads an effort.
HARMONY = ReasoningFormat("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>", False,
                          answer_open="<|channel|>final<|message|>", also_close="<|start|>assistant<|channel|>final<|message|>",
                          harmony=True, end="<|end|>")
# gpt-oss's call to a function after its reasoning: the recipient in the channel's header or the role's.
HARMONY_CALLS = ("<|start|>assistant<|channel|>commentary to=", "<|start|>assistant to=")


def with_calls(fmt: ReasoningFormat) -> ReasoningFormat:
    """The format of a request that offers tools: a harmony model's call ends its reasoning and goes to
    the answer, where the tool parser reads it (without tools it stays in the reasoning, unread)."""
    if not fmt.harmony:
        return fmt
    return dataclasses.replace(fmt, hands_on=tuple(fmt.end + marker for marker in HARMONY_CALLS) + HARMONY_CALLS)


def writes_channels(template_source: str) -> bool:
    """Whether a chat template is gpt-oss's kind: it writes harmony's channels."""
    return "<|channel|>" in template_source and "<|message|>" in template_source


def reasoning_format(template_source: str) -> ReasoningFormat | None:
    """What a chat template says of reasoning: its markers, whether it can be turned off, and
    whether it reads an effort."""
    effort = EFFORT in template_source
    if writes_channels(template_source):
        return dataclasses.replace(HARMONY, effort=effort)
    if OPEN not in template_source or CLOSE not in template_source:
        return None
    return ReasoningFormat(OPEN, CLOSE, SWITCH in template_source, effort=effort)


class Phase(Enum):
    BEFORE = "before"  # the answer may still open with the reasoning marker
    REASONING = "reasoning"
    CONTENT = "content"


def starting_phase(fmt: ReasoningFormat, prompt: str) -> Phase:
    """Where a generation starts, from the prompt it continues."""
    tail = prompt.rstrip()
    if tail.endswith(fmt.open):
        return Phase.REASONING
    if tail.endswith(fmt.close):
        return Phase.CONTENT
    return Phase.BEFORE


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` might begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """Generated text fed as it comes; each feed answers the (reasoning, content) it lets out.
    Whitespace around the reasoning (the newlines after `<think>` and around `</think>`) is
    dropped, as the templates write it for the model, not for the reader."""

    def __init__(self, fmt: ReasoningFormat, phase: Phase) -> None:
        self.fmt, self.phase = fmt, phase
        self._held = ""
        self._trim = phase is not Phase.BEFORE  # drop leading whitespace of what comes next

    def feed(self, text: str) -> tuple[str, str]:
        buffer = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buffer:
            if self._trim:
                buffer = buffer.lstrip()
                if not buffer:
                    break
                self._trim = False
            if self.phase is Phase.BEFORE:
                stripped = buffer.lstrip()
                answer_open = self.fmt.answer_open
                if stripped.startswith(self.fmt.open):
                    self.phase, self._trim = Phase.REASONING, True
                    buffer = stripped[len(self.fmt.open):]
                elif answer_open and stripped.startswith(answer_open):
                    self.phase, self._trim = Phase.CONTENT, True
                    buffer = stripped[len(answer_open):]
                elif self.fmt.open.startswith(stripped) or (answer_open and answer_open.startswith(stripped)):
                    self._held = buffer  # still maybe a marker (or only whitespace)
                    break
                else:
                    self.phase = Phase.CONTENT
            elif self.phase is Phase.REASONING:
                markers = self.fmt.closes + self.fmt.hands_on
                found = [(at, marker) for marker in markers if (at := buffer.find(marker)) >= 0]
                if found:
                    at, marker = min(found, key=lambda f: (f[0], -len(f[1])))  # the first, and the longer where both start there
                    kept = marker in self.fmt.hands_on
                    reasoning.append(buffer[:at].rstrip())
                    self.phase, self._trim = Phase.CONTENT, not kept
                    if kept:  # the answer starts at the marker, less an end-of-message marker before it
                        buffer = buffer[at + (len(self.fmt.end) if self.fmt.end and marker.startswith(self.fmt.end) else 0):]
                    else:
                        buffer = buffer[at + len(marker):]
                    continue
                # Hold what may begin a marker, and trailing whitespace (it may be the last).
                partial = max(_held(buffer, marker) for marker in markers)
                before = buffer[:len(buffer) - partial]
                keep = partial + len(before) - len(before.rstrip())
                reasoning.append(buffer[:len(buffer) - keep])
                self._held = buffer[len(buffer) - keep:]
                break
            else:
                content.append(buffer)
                break
        return "".join(reasoning), "".join(content)

    def end(self) -> tuple[str, str]:
        """What was held when the generation ended: an unclosed reasoning stays reasoning."""
        held, self._held = self._held, ""
        if self.phase is Phase.REASONING:
            return held.rstrip(), ""
        return "", held

    def feed_token(self, text: str) -> tuple[str, str, bool]:
        """feed, and whether the token counts as reasoning: it was read inside the reasoning, or
        opened it, or closed it."""
        inside = self.phase is Phase.REASONING
        reasoning, content = self.feed(text)
        return reasoning, content, inside or self.phase is Phase.REASONING


def split_whole(fmt: ReasoningFormat, phase: Phase, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    split = ReasoningSplit(fmt, phase)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.end()
    return reasoning + more_reasoning, content + more_content
