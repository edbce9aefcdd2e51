"""Reasoning split from the answer (appliance/prompt/reasoning.py): whole answers and the same
text streamed in every possible cut, for the shapes thinking models write."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.prompt.reasoning import Phase, ReasoningFormat, ReasoningSplit, reasoning_format, split_whole, starting_phase

FMT = ReasoningFormat("<think>", "</think>", True)
# Shapes of the families' outputs (written from their published chat templates: Qwen3 and SmolLM3
# open <think> themselves; DeepSeek-R1's distills get it opened by the prompt).
CASES = [
    # (starting phase, generated text, reasoning, content)
    (Phase.BEFORE, "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
    (Phase.BEFORE, "Hello! No thinking here.", "", "Hello! No thinking here."),
    (Phase.BEFORE, "\n<think>\n\n</think>\n\nShort answer.", "", "Short answer."),
    (Phase.REASONING, "Let me add 2 and 2.\nThat is 4.\n</think>\n\nIt is 4.", "Let me add 2 and 2.\nThat is 4.", "It is 4."),
    (Phase.REASONING, "Still thinking when max_tokens ran out", "Still thinking when max_tokens ran out", ""),
    (Phase.CONTENT, "Answer after a closed, empty think.", "", "Answer after a closed, empty think."),
    (Phase.BEFORE, "I write <think> tags in prose.", "", "I write <think> tags in prose."),
    (Phase.BEFORE, "<think>a < b and </thi is not the end</think>ok", "a < b and </thi is not the end", "ok"),
    (Phase.BEFORE, "<thin", "", "<thin"),
    (Phase.CONTENT, "  \n", "", ""),
]


@pytest.mark.parametrize(("phase", "text", "reasoning", "content"), CASES)
def test_a_whole_answer_splits(phase: Phase, text: str, reasoning: str, content: str) -> None:
    assert split_whole(FMT, phase, text) == (reasoning, content)


@pytest.mark.parametrize(("phase", "text", "reasoning", "content"), CASES)
def test_every_cut_of_a_stream_splits_as_the_whole(phase: Phase, text: str, reasoning: str, content: str) -> None:
    for size in range(1, len(text) + 1):
        split = ReasoningSplit(FMT, phase)
        pieces = [split.feed(text[i:i + size]) for i in range(0, len(text), size)] + [split.end()]
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content), size


@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "\n", " ", "a", "b"]), max_size=30),
       st.sampled_from(list(Phase)))
def test_any_token_cuts_give_the_whole_answers_split(tokens: list[str], phase: Phase) -> None:
    split = ReasoningSplit(FMT, phase)
    pieces = [split.feed(t) for t in tokens] + [split.end()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == split_whole(FMT, phase, "".join(tokens))


def test_tokens_that_open_hold_or_close_the_reasoning_count_as_reasoning() -> None:
    split = ReasoningSplit(FMT, Phase.BEFORE)
    counted = [split.feed_token(t)[2] for t in ["<think>", "\n", "hmm", "\n", "</think>", "\n\n", "Hi", "!"]]
    assert counted == [True, True, True, True, True, False, False, False]


def test_the_template_says_whether_it_reasons_and_can_stop() -> None:
    qwen3_like = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    r1_like = "{{'<|Assistant|>'}}{% if add_generation_prompt %}{{'<think>\\n'}}{% endif %}{# </think> stripped from history #}"
    assert reasoning_format(qwen3_like) == ReasoningFormat("<think>", "</think>", True)
    assert reasoning_format(r1_like) == ReasoningFormat("<think>", "</think>", False)
    assert reasoning_format("{{ '<|im_start|>assistant\\n' }}") is None
    assert starting_phase(FMT, "<|im_start|>assistant\n<think>\n") is Phase.REASONING
    assert starting_phase(FMT, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is Phase.CONTENT
    assert starting_phase(FMT, "<|im_start|>assistant\n") is Phase.BEFORE
