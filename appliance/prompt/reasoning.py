"""Reasoning kept apart from the answer, for models that think before they answer (Qwen3, QwQ,
DeepSeek-R1's distills, SmolLM3, Phi-4-reasoning: `<think>…</think>` before the answer).

A model's template says whether it reasons (it writes the markers) and whether a request may turn
it off (it reads `enable_thinking`, as Qwen3's and SmolLM3's do). Where the split starts is read
from each request's rendered prompt: one that ends inside an opened `<think>` (DeepSeek-R1's
templates open it) starts in the reasoning; one that ends after a closed, empty one (thinking
turned off) starts in the answer; otherwise the answer may open with one.

The split is pure: text in, (reasoning, content) out, as generated text arrives token by token;
a piece that may be the start of a marker is held until it is known."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from engines.interface import THINK_CLOSE as CLOSE, THINK_OPEN as OPEN

SWITCH = "enable_thinking"  # the template variable a request's "no reasoning" sets to false


@dataclass(frozen=True)
class ReasoningFormat:
    open: str
    close: str
    switchable: bool  # the template turns it off when asked


def reasoning_format(template_source: str) -> ReasoningFormat | None:
    """What a chat template says of reasoning: its markers, and whether it can be turned off."""
    if OPEN not in template_source or CLOSE not in template_source:
        return None
    return ReasoningFormat(OPEN, CLOSE, SWITCH in template_source)


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
                if stripped.startswith(self.fmt.open):
                    self.phase, self._trim = Phase.REASONING, True
                    buffer = stripped[len(self.fmt.open):]
                elif self.fmt.open.startswith(stripped):  # still maybe the marker (or only whitespace)
                    self._held = buffer
                    break
                else:
                    self.phase = Phase.CONTENT
            elif self.phase is Phase.REASONING:
                at = buffer.find(self.fmt.close)
                if at >= 0:
                    reasoning.append(buffer[:at].rstrip())
                    self.phase, self._trim = Phase.CONTENT, True
                    buffer = buffer[at + len(self.fmt.close):]
                    continue
                # Hold what may begin the closing marker, and trailing whitespace (it may be the last).
                partial = _held(buffer, self.fmt.close)
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
