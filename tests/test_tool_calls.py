"""The pure parts of tool calling: reading calls out of text (whole and streamed), the forcing
grammar, the template forms, and the request checks' message shapes. No model, no IO."""

from __future__ import annotations

import json

import pytest
from llama_cpp import LlamaGrammar

from appliance.prompt.tool_calls import (
    StreamParser,
    Tool,
    ToolCall,
    ToolPlan,
    arguments_problem,
    call_text,
    grammar,
    parse,
    template_form,
)
from appliance.prompt.reasoning import HARMONY, Phase, ReasoningSplit, split_whole, with_calls

CALC = Tool("calculator", "Evaluates arithmetic.", {"type": "object", "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"]})
LOOKUP = Tool("lookup", "Looks a word up.", {"type": "object", "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}},
                                              "required": ["word"]})
PLAN = ToolPlan((CALC, LOOKUP))
LLAMA = ToolPlan((CALC, LOOKUP), format="llama")


def test_hermes_call_is_read_with_its_arguments() -> None:
    parsed = parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>', PLAN)
    assert parsed.content is None and parsed.problem is None
    (call,) = parsed.calls
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2*3"}
    assert call.id.startswith("call_") and len(call.id) > 10


def test_text_around_calls_is_content_and_parallel_calls_are_kept_in_order() -> None:
    text = ('Let me check.\n<tool_call>{"name": "lookup", "arguments": {"word": "a"}}</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    parsed = parse(text, PLAN)
    assert parsed.content == "Let me check."
    assert [c.name for c in parsed.calls] == ["lookup", "calculator"]
    assert json.loads(parsed.calls[1].arguments) == {"expression": "1+1"}  # arguments given as a JSON string
    single = parse(text, ToolPlan((CALC, LOOKUP), parallel=False))
    assert [c.name for c in single.calls] == ["lookup"]


@pytest.mark.parametrize(("text", "problem"), [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "not JSON"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "not one of the tools"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "not a JSON object"),
    ('<tool_call>["calculator"]</tool_call>', "string 'name'"),
])
def test_malformed_calls_stay_text_with_the_reason(text: str, problem: str) -> None:
    parsed = parse(text, PLAN)
    assert parsed.calls == () and parsed.content == text
    assert parsed.problem is not None and problem in parsed.problem


def test_plain_text_is_content() -> None:
    assert parse("The answer is 4.", PLAN) == parse("The answer is 4.", PLAN)
    parsed = parse("The answer is 4.", PLAN)
    assert parsed.content == "The answer is 4." and parsed.calls == () and parsed.problem is None


def test_a_call_cut_off_before_its_close_tag_still_counts_when_it_parses() -> None:
    parsed = parse('<tool_call>\n{"name": "lookup", "arguments": {"word": "x"}}\n', PLAN)
    assert [c.name for c in parsed.calls] == ["lookup"]


def test_llama_form() -> None:
    parsed = parse('<|python_tag|>{"name": "lookup", "parameters": {"word": "cat"}}', LLAMA)
    assert [c.name for c in parsed.calls] == ["lookup"] and json.loads(parsed.calls[0].arguments) == {"word": "cat"}
    assert parse("A cat is an animal.", LLAMA).calls == ()
    assert parse('{"name": "nope", "parameters": {}}', LLAMA).problem is not None


def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser = StreamParser(plan)
    outs: list[str | ToolCall] = []
    for piece in pieces:
        outs += parser.feed(piece)
    outs += parser.end()
    assert parser.calls == [o for o in outs if isinstance(o, ToolCall)]
    return "".join(o for o in outs if isinstance(o, str)), [o for o in outs if isinstance(o, ToolCall)]


def _chars(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize("split", [_chars, lambda t: [t], lambda t: [t[i:i + 5] for i in range(0, len(t), 5)]])
def test_streamed_calls_match_whole_parsing_however_the_text_is_split(split) -> None:  # type: ignore[no-untyped-def]
    text = ('Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": {"word": "<tool"}}</tool_call>')
    content, calls = _stream(PLAN, split(text))
    assert content.strip() == "Sure."  # blank text just before a call may be dropped
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculator", {"expression": "3*4"}), ("lookup", {"word": "<tool"})]


def test_stream_holds_a_possible_tag_but_releases_plain_text() -> None:
    parser = StreamParser(PLAN)
    assert parser.feed("a <") == ["a "]
    assert parser.feed("b") == ["<b"]
    assert parser.feed(" <tool_ca") == []  # blank text is held too: a call may follow
    assert parser.feed("ke") == [" <tool_cake"]
    assert parser.end() == []


def test_stream_releases_a_malformed_call_as_text_and_a_cut_off_one_at_the_end() -> None:
    content, calls = _stream(PLAN, ["<tool_call>{oops}</tool_call>"])
    assert calls == [] and content == "<tool_call>{oops}</tool_call>"
    content, calls = _stream(PLAN, ['<tool_call>{"name": "lookup", "arguments": {"word": "z"}}'])
    assert [c.name for c in calls] == ["lookup"] and content == ""


def test_stream_llama_form_holds_a_json_answer_and_streams_text() -> None:
    content, calls = _stream(LLAMA, ['{"name": "lookup", ', '"parameters": {"word": "q"}}'])
    assert [c.name for c in calls] == ["lookup"] and content == ""
    content, calls = _stream(LLAMA, ["Hello", " there"])
    assert content == "Hello there" and calls == []


@pytest.mark.parametrize("plan", [ToolPlan((CALC, LOOKUP), mode="required"), ToolPlan((CALC, LOOKUP), mode="required", forced="lookup"),
                                  ToolPlan((CALC,), mode="required", format="llama")])
def test_forcing_grammar_compiles_and_accepts_a_call_that_parses(plan: ToolPlan) -> None:
    text = grammar(plan)
    LlamaGrammar.from_string(text, verbose=False)  # llama.cpp's own parser accepts it
    assert "tool-call-json ::=" in text and text.count("root ::=") == 1
    if plan.forced == "lookup":
        assert '"\\"lookup\\""' in text and "calculator" not in text


def test_template_forms() -> None:
    assert template_form(True, "... <tool_call> ...") == (True, "hermes")
    assert template_form(True, '{"name": ..., "parameters": ...} <|python_tag|>') == (True, "llama")
    assert template_form(False, "<|im_start|>") == (False, "hermes")
    assert template_form(True, "tools rendered some other way") == (False, "hermes")


def test_call_text_round_trips_through_parse() -> None:
    assert parse(call_text("lookup", {"word": "w"}), PLAN).calls[0].name == "lookup"
    assert parse(call_text("lookup", {"word": "w"}, "llama"), LLAMA).calls[0].name == "lookup"


def test_arguments_problem_checks_the_schema() -> None:
    assert arguments_problem(ToolCall("call_1", "lookup", '{"word": "w", "limit": 2}'), PLAN) is None
    problem = arguments_problem(ToolCall("call_1", "lookup", '{"limit": "two"}'), PLAN)
    assert problem is not None and "lookup" in problem


def test_a_close_tag_inside_the_arguments_does_not_cut_the_call() -> None:
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "}}</tool_call>"}}\n</tool_call>\nafter'
    parsed = parse(text, PLAN)
    assert [json.loads(c.arguments) for c in parsed.calls] == [{"expression": "}}</tool_call>"}] and parsed.content == "after"
    content, calls = _stream(PLAN, _chars(text))
    assert [json.loads(c.arguments) for c in calls] == [{"expression": "}}</tool_call>"}] and content.strip() == "after"


def test_forcing_grammar_keeps_control_characters_out_of_strings() -> None:
    # JSON forbids a raw newline inside a string; the converter's own rule would allow one.
    assert 'char ::= [^"\\\\\\x7F\\x00-\\x1F]' in grammar(ToolPlan((CALC,), mode="required"))


def test_a_bare_json_call_counts_in_the_hermes_form_too() -> None:
    text = '{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}'
    assert [c.name for c in parse(text, PLAN).calls] == ["calculator"]
    content, calls = _stream(PLAN, _chars(text))
    assert [c.name for c in calls] == ["calculator"] and content == ""
    other = '{"colour": "red"}'  # a JSON answer that is no call stays content, with no problem to escalate on
    assert parse(other, PLAN) == parse(other, PLAN) and parse(other, PLAN).content == other and parse(other, PLAN).problem is None
    assert _stream(PLAN, _chars(other)) == (other, [])


def test_tools_reach_a_template_that_renders_them_and_control_text_in_them_is_refused() -> None:
    from appliance.prompt.chat import chat_prompt
    from appliance.prompt.template import ChatTemplate, TemplateError

    template = ChatTemplate("{% for t in tools %}{{ t | tojson }}{% endfor %}"
                            "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}", {})
    assert template.uses_tools
    controls = {"<|im_start|>": 1, "<|im_end|>": 2}

    def tokenize(text: str) -> list[int]:
        return [1000 + ord(c) for c in text]

    text, tokens = chat_prompt(template, [{"role": "user", "content": "<|im_end|>"}], controls, tokenize, [], tools=[LOOKUP.wire()])
    assert text.startswith('{"type": "function", "function": {"name": "lookup"')  # Hugging Face's tojson: keys in order
    assert [t for t in tokens if t < 1000] == [1, 2]  # the caller's "<|im_end|>" stayed text
    with pytest.raises(TemplateError, match="control token"):
        chat_prompt(template, [{"role": "user", "content": "hi"}], controls, tokenize, [],
                    tools=[Tool("f", "x<|im_end|>", {"type": "object"}).wire()])


def test_a_fenced_json_call_that_is_the_whole_answer_counts_and_fenced_code_streams_on() -> None:
    # Qwen2.5-Coder-1.5B under Claude Code's long prompt writes its call so.
    text = '```json\n{\n  "name": "calculator",\n  "arguments": {"expression": "2 + 2"}\n}\n```'
    assert [(c.name, json.loads(c.arguments)) for c in parse(text, PLAN).calls] == [("calculator", {"expression": "2 + 2"})]
    content, calls = _stream(PLAN, _chars(text))
    assert [c.name for c in calls] == ["calculator"] and content == ""
    for answer in ('Here:\n```json\n{"name": "calculator", "arguments": {}}\n```',  # a call shown in prose stays text
                   '```json\n{"name": "nothing", "arguments": {}}\n```',  # no such tool
                   '```python\nprint("{}")\n```'):
        assert parse(answer, PLAN).calls == () and parse(answer, PLAN).content == answer
        assert _stream(PLAN, _chars(answer)) == (answer, [])
    # Code is not held to the end: a fence goes on once its language or first line says it is no call.
    assert StreamParser(PLAN).feed("```py") == ["```py"]
    code = StreamParser(PLAN)
    assert code.feed("```") == [] and code.feed("json\n") == [] and code.feed("[1, 2]") == ["```json\n[1, 2]"]


# Mistral's two call forms, as its tokenizers write them (mistral-common's documented formats):
# the v3-v7 tokenizers a JSON list after [TOOL_CALLS]; v11+ `[TOOL_CALLS]name[ARGS]{...}` per call.
MISTRAL = ToolPlan((CALC, LOOKUP), format="mistral")
MISTRAL_ARGS = ToolPlan((CALC, LOOKUP), format="mistral_args")
MISTRAL_ANSWERS = [
    (MISTRAL, '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "3*4"}}]', None),
    (MISTRAL, 'Let me look.[TOOL_CALLS] [{"name": "lookup", "arguments": {"word": "a"}}, '
              '{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}]', "Let me look."),
    (MISTRAL_ARGS, '[TOOL_CALLS]calculator[ARGS]{"expression": "3*4"}', None),
    (MISTRAL_ARGS, 'Two calls.[TOOL_CALLS]lookup[ARGS]{"word": "a"}[TOOL_CALLS]calculator[ARGS]{"expression": "1+1"}', "Two calls."),
    (MISTRAL_ARGS, '[TOOL_CALLS][{"name": "lookup", "arguments": {"word": "a"}}]', None),  # either form reads in both
]


@pytest.mark.parametrize(("plan", "text", "content"), MISTRAL_ANSWERS)
def test_mistral_calls_are_read_whole_and_streamed_at_every_cut(plan: ToolPlan, text: str, content: str | None) -> None:
    parsed = parse(text, plan)
    assert parsed.calls and parsed.problem is None and parsed.content == content
    whole = [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    for size in (1, 3, 7, len(text)):
        streamed_content, calls = _stream(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert [(c.name, json.loads(c.arguments)) for c in calls] == whole
        assert streamed_content.strip() == (content or "")


def test_mistral_text_without_calls_streams_on_and_a_broken_call_says_why() -> None:
    content, calls = _stream(MISTRAL, ["A plain [TOOL", "_CALL answer."])
    assert content == "A plain [TOOL_CALL answer." and calls == []
    assert parse("[TOOL_CALLS]not json", MISTRAL).problem == "the call is not JSON"
    assert parse('[TOOL_CALLS]nope[ARGS]{"x": 1}', MISTRAL_ARGS).problem is not None
    one = ToolPlan((CALC, LOOKUP), format="mistral", parallel=False)
    assert len(parse(MISTRAL_ANSWERS[1][1], one).calls) == 1


@pytest.mark.parametrize("plan", [ToolPlan((CALC, LOOKUP), mode="required", format="mistral"),
                                  ToolPlan((CALC, LOOKUP), mode="required", format="mistral_args"),
                                  ToolPlan((CALC, LOOKUP), mode="required", forced="lookup", format="mistral_args")])
def test_mistral_forcing_grammars_compile(plan: ToolPlan) -> None:
    text = grammar(plan)
    LlamaGrammar.from_string(text, verbose=False)
    assert text.count("root ::=") == 1 and '"[TOOL_CALLS]' in text
    if plan.forced == "lookup":
        assert "lookup[ARGS]" in text and "calculator" not in text


def test_mistral_templates_and_call_text() -> None:
    assert template_form(True, "{%- for tool_call in message.tool_calls %}[TOOL_CALLS][{{ tool_call | tojson }}]") == (True, "mistral")
    assert template_form(True, "{{- '[TOOL_CALLS]' + tool.name + '[ARGS]' + arguments }}") == (True, "mistral_args")
    for plan in (MISTRAL, MISTRAL_ARGS):
        assert parse(call_text("lookup", {"word": "w"}, plan.format), plan).calls[0].name == "lookup"


# gpt-oss's calls on its commentary channel, after its reasoning, in the shapes OpenAI's harmony format
# documents (the recipient in the channel's header or the role's; `<|constrain|>json`, ` json` or neither).
# llama.cpp writes <|start|>, <|channel|>, <|constrain|> and <|message|> as text, and neither <|end|> (a
# control token) nor <|call|> (an end of generation); an engine that writes every token's text writes both.
HARMONY_PLAN = ToolPlan((CALC, LOOKUP), format="harmony")
HARMONY_ANSWERS = [
    # (generated text, reasoning, content, calls)
    ('<|channel|>analysis<|message|>Need to use function lookup.<|start|>assistant<|channel|>commentary to=functions.lookup '
     '<|constrain|>json<|message|>{"word":"cat"}', "Need to use function lookup.", "", [("lookup", {"word": "cat"})]),
    ('<|channel|>analysis<|message|>Compute it.<|end|><|start|>assistant<|channel|>commentary to=functions.calculator '
     '<|constrain|>json<|message|>{"expression": "3*4"}<|call|>', "Compute it.", "", [("calculator", {"expression": "3*4"})]),
    ('<|channel|>analysis<|message|>Look it up.<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>'
     '{"word": "dog", "limit": 2}', "Look it up.", "", [("lookup", {"word": "dog", "limit": 2})]),
    ('<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression":"2+2"}', "", "",
     [("calculator", {"expression": "2+2"})]),
    ('<|channel|>analysis<|message|>a <|start|> b.<|start|>assistant<|channel|>commentary to=functions.lookup<|message|>{"word": "x"}',
     "a <|start|> b.", "", [("lookup", {"word": "x"})]),
    ("<|channel|>analysis<|message|>No tool needed.<|start|>assistant<|channel|>final<|message|>It is 4.", "No tool needed.",
     "It is 4.", []),
    ("<|channel|>analysis<|message|>Cut off by max_tokens", "Cut off by max_tokens", "", []),
]


def _harmony_answer(text: str, size: int) -> tuple[str, str, list[tuple[str, dict]]]:
    """The text through the reasoning split (as a request with tools reads it) and the tool parser, in pieces of `size`."""
    split, parser = ReasoningSplit(with_calls(HARMONY), Phase.BEFORE), StreamParser(HARMONY_PLAN)
    reasoning: list[str] = []
    outs: list[str | ToolCall] = []
    for piece in [text[i:i + size] for i in range(0, len(text), size)]:
        r, c = split.feed(piece)
        reasoning.append(r)
        outs += parser.feed(c)
    r, c = split.end()
    reasoning.append(r)
    outs += parser.feed(c) + parser.end()
    calls = [(o.name, json.loads(o.arguments)) for o in outs if isinstance(o, ToolCall)]
    return "".join(reasoning), "".join(o for o in outs if isinstance(o, str)), calls


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), HARMONY_ANSWERS)
def test_harmony_calls_are_read_after_the_reasoning_whole_and_at_every_cut(text: str, reasoning: str, content: str,
                                                                            calls: list[tuple[str, dict]]) -> None:
    whole_reasoning, whole_content = split_whole(with_calls(HARMONY), Phase.BEFORE, text)
    parsed = parse(whole_content, HARMONY_PLAN)
    assert whole_reasoning == reasoning and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert (parsed.content or "") == content and parsed.problem is None
    for size in range(1, len(text) + 1):
        assert _harmony_answer(text, size) == (reasoning, content, calls), size


def test_without_tools_a_harmony_call_stays_in_the_reasoning_and_a_broken_one_says_why() -> None:
    text = HARMONY_ANSWERS[0][0]
    reasoning, content = split_whole(HARMONY, Phase.BEFORE, text)  # no tools offered: nothing reads a call
    assert content == "" and "to=functions.lookup" in reasoning
    assert parse("<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{not json", HARMONY_PLAN).problem == "the call is not JSON"
    assert parse('<|channel|>commentary to=functions.nope<|message|>{"x": 1}', HARMONY_PLAN).problem is not None
    assert _stream(HARMONY_PLAN, ["A plain <|sta", "rt|> answer."]) == ("A plain <|start|> answer.", [])
    with pytest.raises(ValueError, match="forced call"):
        grammar(ToolPlan((CALC,), mode="required", format="harmony"))


def test_harmony_templates_write_calls_in_channels() -> None:
    source = "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}"
    assert template_form(True, source) == (True, "harmony")
    assert template_form(False, source) == (False, "hermes")  # a template that renders no tools is taught the generic form


@pytest.mark.parametrize(("fmt", "marker"), [("hermes", "<tool_call>\n"), ("mistral", "[TOOL_CALLS]"), ("mistral_args", "[TOOL_CALLS]f[ARGS]"),
                                             ("harmony", "<|channel|>commentary to=functions.calculator<|message|>"), ("llama", "")])
def test_a_call_nested_past_the_recursion_limit_is_text_whole_and_streamed(fmt: str, marker: str) -> None:
    plan = ToolPlan((CALC,), format=fmt)  # type: ignore[arg-type]
    text = marker + "[" * 3000
    assert parse(text, plan).calls == () and parse("{" * 3000, plan).calls == ()
    assert _stream(plan, [text[i:i + 100] for i in range(0, len(text), 100)]) == (text, [])
