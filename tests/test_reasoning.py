"""Reasoning split from the answer (appliance/prompt/reasoning.py): whole answers and the same
text streamed in every possible cut, for the shapes thinking models write."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.prompt.reasoning import (
    HARMONY,
    Phase,
    ReasoningFormat,
    ReasoningSplit,
    reasoning_format,
    split_whole,
    starting_phase,
    with_calls,
)
from appliance.prompt.template import ChatTemplate

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


# gpt-oss's harmony channels, as the prompt leaves it after `<|start|>assistant`. llama.cpp writes <|channel|>,
# <|message|> and <|start|> as text and <|end|> (a control token) not at all; an engine that writes every token's
# text writes <|end|> too. The first shape is a gpt-oss answer as published beside a parser's tests.
HARMONY_CASES = [
    (Phase.BEFORE, '<|channel|>analysis<|message|>User says "sup homey". They are greeting. We respond casually.'
                   "<|start|>assistant<|channel|>final<|message|>Hey! What's up?", 'User says "sup homey". They are greeting. We respond casually.',
     "Hey! What's up?"),
    (Phase.BEFORE, "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     "Two and two.", "It is 4."),
    (Phase.BEFORE, "<|channel|>final<|message|>Straight to the answer.", "", "Straight to the answer."),
    (Phase.BEFORE, "<|channel|>analysis<|message|>Cut off by max_tokens<|en", "Cut off by max_tokens<|en", ""),
    (Phase.BEFORE, "An answer with no channel.", "", "An answer with no channel."),
    (Phase.BEFORE, "<|channel|>analysis<|message|>a <|start|> b<|start|>assistant<|channel|>final<|message|>c", "a <|start|> b", "c"),
]
SHAPES = [(FMT, *case) for case in CASES] + [(HARMONY, *case) for case in HARMONY_CASES]


@pytest.mark.parametrize(("fmt", "phase", "text", "reasoning", "content"), SHAPES)
def test_a_whole_answer_splits(fmt: ReasoningFormat, phase: Phase, text: str, reasoning: str, content: str) -> None:
    assert split_whole(fmt, phase, text) == (reasoning, content)


@pytest.mark.parametrize(("fmt", "phase", "text", "reasoning", "content"), SHAPES)
def test_every_cut_of_a_stream_splits_as_the_whole(fmt: ReasoningFormat, phase: Phase, text: str, reasoning: str, content: str) -> None:
    for size in range(1, len(text) + 1):
        split = ReasoningSplit(fmt, phase)
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


HARMONY_TOKENS = ["<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>", "assistant", "a", " ", "\n"]


@given(st.lists(st.sampled_from(HARMONY_TOKENS), max_size=30))
def test_any_harmony_token_cuts_give_the_whole_answers_split(tokens: list[str]) -> None:
    split = ReasoningSplit(HARMONY, Phase.BEFORE)
    pieces = [split.feed(t) for t in tokens] + [split.end()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == split_whole(HARMONY, Phase.BEFORE, "".join(tokens))


# The parts of gpt-oss's template that say how it reasons (its system turn names the effort, "medium" unless given).
GPT_OSS_LIKE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                "{% for m in messages %}{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
                "{% else %}<|start|>{{ m['role'] }}<|message|>{% endif %}{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_gpt_oss_templates_reason_in_channels_take_an_effort_and_cannot_stop() -> None:
    template = ChatTemplate(GPT_OSS_LIKE, {})
    assert template.reasoning is not None and template.reasoning.open == HARMONY.open and template.reasoning.effort
    asked = [{"role": "user", "content": "Hi"}]
    assert "Reasoning: medium" in template.with_effort(None).render(asked)
    assert "Reasoning: low" in template.with_effort("low").render(asked)
    assert starting_phase(template.reasoning, template.render(asked)) is Phase.BEFORE
    with pytest.raises(Exception, match="no enable_thinking switch"):
        template.with_effort("none")
    qwen3_like = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}<think></think>{{ enable_thinking }}", {})
    assert qwen3_like.with_effort("high") is qwen3_like  # a template that reads no effort renders as it is


HARMONY_CALL_TOKENS = HARMONY_TOKENS + ["commentary", " to=", "functions.f", "<|constrain|>", "json", "{}"]


@given(st.lists(st.sampled_from(HARMONY_CALL_TOKENS), max_size=30))
def test_any_harmony_token_cuts_with_a_call_give_the_whole_answers_split(tokens: list[str]) -> None:
    """With tools offered, a call's header ends the reasoning and stays for the tool parser."""
    fmt = with_calls(HARMONY)
    split = ReasoningSplit(fmt, Phase.BEFORE)
    pieces = [split.feed(t) for t in tokens] + [split.end()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == split_whole(fmt, Phase.BEFORE, "".join(tokens))
