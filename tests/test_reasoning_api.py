"""A reasoning model's reasoning, kept apart from its answer on all four APIs, through real HTTP.

No thinking model ships in a package here, so the bundled SmolLM2 runs under a chat template that
opens `<think>` as DeepSeek-R1's do, with Qwen3's `enable_thinking` switch: its generation starts
inside the reasoning, and (never writing `</think>` itself) stays there to max_tokens. Turned off,
the template closes an empty `<think>` and the model answers. The split of answers that do close
their reasoning is tested on the families' shapes in tests/test_reasoning.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from appliance.pipeline.call import Outgoing
from appliance.prompt.reasoning import Phase, ReasoningFormat, ReasoningSplit
from engines.interface import FinishEvent, Usage
from tests.conftest import CHAT_MODEL, Server, config_text, start_server, stop_server
from tests.scripted_upstream import ScriptedUpstream

THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "What is two plus two?"}]


def _under(tmp_path_factory: pytest.TempPathFactory, name: str, template: str, slots: int) -> Iterator[Server]:
    """The bundled model served under `template`."""
    extra = f"chat_template = '''{template}'''"
    server = start_server(tmp_path_factory.mktemp(name), config_text(slots=slots, embeddings=False, model_extra=extra))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _under(tmp_path_factory, "thinker", THINKING_TEMPLATE, 2)


# A gpt-oss-like template (harmony's channels, an effort in the prompt) whose generation prompt opens the
# analysis channel, so the bundled model's words are its reasoning.
HARMONY_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>developer\\n# Tools\\nnamespace functions {' }}{% for t in tools %}"
    "{{ ' type ' + t.function.name + ' = (_: any) => any;' }}{% endfor %}{{ ' }<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}{% for c in message.tool_calls %}"
    "{{ '<|im_start|>assistant to=functions.' + c.function.name + '<|channel|>commentary json<|message|>' + (c.function.arguments | tojson) + '<|im_end|>\\n' }}"
    "{% endfor %}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\nReasoning: ' + (reasoning_effort | default('medium')) + '\\n' }}"
    "{{ '<|channel|>analysis<|message|>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _under(tmp_path_factory, "harmony", HARMONY_TEMPLATE, 1)


def test_a_harmony_template_reasons_in_its_analysis_channel_takes_an_effort_and_cannot_stop(harmony: Server) -> None:
    answer = harmony.client().chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                                      reasoning_effort="low")
    message = answer.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] and message.content == ""
    refused = httpx.post(f"{harmony.base_url}/v1/chat/completions", timeout=60,
                         json={"model": CHAT_MODEL, "messages": ASK, "reasoning_effort": "none"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"



def test_a_harmony_template_takes_tools_and_their_turns_and_cannot_force_a_call(harmony: Server) -> None:
    """Its calls are read on its commentary channel (their shapes at every stream cut: tests/test_tool_calls.py);
    the bundled model writes none, so here: the tools reach the template, the turns render, the words are reasoning."""
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    with_tools = harmony.client().chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=[tool], max_tokens=8,  # type: ignore[arg-type,list-item]
                                                          temperature=0)
    assert (with_tools.choices[0].message.model_extra or {})["reasoning_content"] and not with_tools.choices[0].message.tool_calls
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                          "function": {"name": "now", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    streamed = httpx.post(f"{harmony.base_url}/v1/chat/completions", timeout=60,
                          json={"model": CHAT_MODEL, "messages": turns, "tools": [tool], "max_tokens": 8, "stream": True})
    assert streamed.status_code == 200 and any(c["choices"] and c["choices"][0]["delta"].get("reasoning_content") for c in _sse(streamed))
    forced = httpx.post(f"{harmony.base_url}/v1/chat/completions", timeout=60,
                        json={"model": CHAT_MODEL, "messages": ASK, "tools": [tool], "tool_choice": "required"})
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"  # a grammar would skip its reasoning
    unused = httpx.post(f"{harmony.base_url}/v1/chat/completions", timeout=60,
                        json={"model": CHAT_MODEL, "messages": ASK, "tools": [tool], "tool_choice": "none", "max_tokens": 4})
    assert unused.status_code == 200, unused.text


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text[:400]
    return response


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_chat_splits_reasoning_whole_and_streamed_and_counts_its_tokens(thinker: Server) -> None:
    client = thinker.client()
    whole = client.chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    message = whole.choices[0].message
    thought = (message.model_extra or {})["reasoning_content"]
    assert thought and (message.model_extra or {})["reasoning"] == thought and message.content == ""
    assert "<think>" not in thought and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens == 12
    streamed = client.chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    pieces = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices]
    assert "".join(p for p in pieces if p) == thought
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12  # type: ignore[union-attr]


def test_reasoning_effort_none_turns_thinking_off_through_the_template(thinker: Server) -> None:
    answer = thinker.client().chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                                      reasoning_effort="none")
    message = answer.choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
    assert answer.usage is not None and answer.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]
    refused = httpx.post(f"{thinker.base_url}/v1/chat/completions", timeout=60,
                         json={"model": CHAT_MODEL, "messages": ASK, "reasoning_effort": "extreme"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"


def test_messages_gives_a_thinking_block_and_disabled_turns_it_off(thinker: Server) -> None:
    client = anthropic.Anthropic(base_url=thinker.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(model=CHAT_MODEL, max_tokens=10, messages=ASK, extra_body={"temperature": 0})  # type: ignore[arg-type]
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text"], kinds
    thought = message.content[0].thinking  # type: ignore[union-attr]
    with client.messages.stream(model=CHAT_MODEL, max_tokens=10, messages=ASK, extra_body={"temperature": 0}) as stream:  # type: ignore[arg-type]
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]  # type: ignore[union-attr]
        final = stream.get_final_message()
    assert "".join(deltas) == thought and [b.type for b in final.content] == ["thinking", "text"]
    plain = client.messages.create(model=CHAT_MODEL, max_tokens=10, messages=ASK, extra_body={"temperature": 0},  # type: ignore[arg-type]
                                   thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text  # type: ignore[union-attr]


def test_responses_gives_a_reasoning_item_before_the_message(thinker: Server) -> None:
    client = thinker.client()
    response = client.responses.create(model=CHAT_MODEL, input="What is two plus two?", max_output_tokens=10, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    thought = response.output[0].content[0].text  # type: ignore[union-attr,index]
    assert thought and response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 10
    events = list(client.responses.create(model=CHAT_MODEL, input="What is two plus two?", max_output_tokens=10, temperature=0,
                                          stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == thought
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["reasoning", "message"]  # type: ignore[union-attr]
    plain = client.responses.create(model=CHAT_MODEL, input="What is two plus two?", max_output_tokens=10, temperature=0,
                                    reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"]


def test_ollama_gives_thinking_and_think_false_turns_it_off(thinker: Server) -> None:
    body = {"model": f"{CHAT_MODEL}:latest", "messages": ASK, "stream": False, "options": {"num_predict": 10, "temperature": 0}}
    whole = _post(thinker, "/api/chat", body).json()
    assert whole["message"]["thinking"] and whole["message"]["content"] == ""
    lines = [json.loads(line) for line in _post(thinker, "/api/chat", {**body, "stream": True}).text.splitlines()]
    assert "".join(line["message"].get("thinking", "") for line in lines) == whole["message"]["thinking"]
    plain = _post(thinker, "/api/chat", {**body, "think": False}).json()
    assert "thinking" not in plain["message"] and plain["message"]["content"]
    generated = _post(thinker, "/api/generate", {"model": CHAT_MODEL, "prompt": "What is two plus two?", "stream": False,
                                                 "options": {"num_predict": 10, "temperature": 0}}).json()
    assert generated["thinking"] and generated["response"] == ""


class _Recorder:
    """A wire that records what the pipeline sends it, to see the answer apart from the reasoning."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def delta(self, index: int, text: str, logprob: object) -> list[bytes]:
        self.sent.append(("content", text))
        return []

    def reasoning(self, index: int, text: str) -> list[bytes]:
        self.sent.append(("reasoning", text))
        return []


def test_what_a_stream_keeps_for_the_cache_is_the_answer_without_its_reasoning() -> None:
    wire = _Recorder()
    out = Outgoing(wire, None, 0, ReasoningSplit(ReasoningFormat("<think>", "</think>", True), Phase.BEFORE))  # type: ignore[arg-type]
    for token in ["<think>", "\n", "Two and two", " make four.", "\n</", "think>", "\n\n", "It is", " 4."]:
        out.token(token, None)
    _, finish = out.finished(FinishEvent("stop", Usage(5, 9)))
    assert "".join(out.content) == "It is 4."  # what `remember` stores
    assert "".join(t for k, t in wire.sent if k == "reasoning") == "Two and two make four."
    assert finish.usage.reasoning_tokens == 6


# A thinking model served by another server: llama-server and DeepSeek's API send its reasoning as
# `reasoning_content` deltas, newer vLLM and Ollama as `reasoning`; the answer follows as content.
THOUGHT = ["Two and", " two make", " four."]


def _thinking(field: str) -> list[dict[str, Any]]:
    return [{field: piece} for piece in THOUGHT] + [{"content": "It is"}, {"content": " 4."}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, thinker: Server) -> Iterator[tuple[Server, ScriptedUpstream]]:
    """An appliance whose models run elsewhere: the thinker above (a real model, through real HTTP), a
    scripted thinking model that closes its reasoning (none that does ships here), and a route over it."""
    def usage(body: dict[str, Any], deltas: list[dict[str, Any]]) -> dict[str, Any]:
        counted = {"prompt_tokens": 20, "completion_tokens": len(deltas)}  # llama-server-shaped counts its reasoning; the other does not
        return counted if body["model"] == "vllm-shaped" else {**counted, "completion_tokens_details": {"reasoning_tokens": len(THOUGHT)}}

    scripted = ScriptedUpstream(lambda body: _thinking("reasoning" if body["model"] == "vllm-shaped" else "reasoning_content"), usage)
    config = """
[auth]
mode = "open"

[cache]
enabled = false

[defaults]
max_tokens = 64
"""
    for alias, url, upstream_model in [("thought", f"{thinker.base_url}/v1", CHAT_MODEL), ("scripted", scripted.url, "llama-shaped"),
                                       ("vllm", scripted.url, "vllm-shaped")]:
        config += f"""
[[models]]
alias = "{alias}"
engine = "openai"
base_url = "{url}"
upstream_model = "{upstream_model}"
health_interval_s = 0
"""
    config += '\n[[routes]]\nalias = "auto"\ntiers = ["scripted"]\n'
    server = start_server(tmp_path_factory.mktemp("gateway"), config)
    yield server, scripted
    stop_server(server)
    scripted.close()


def test_an_upstreams_reasoning_reaches_the_caller_apart_whole_and_streamed(gateway: tuple[Server, ScriptedUpstream], thinker: Server) -> None:
    server, _ = gateway
    direct = thinker.client().chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    relayed = server.client().chat.completions.create(model="thought", messages=ASK, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    thought = (direct.choices[0].message.model_extra or {})["reasoning_content"]
    message = relayed.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == thought and message.content == ""
    assert relayed.usage is not None and relayed.usage.completion_tokens_details.reasoning_tokens > 0  # type: ignore[union-attr]
    chunks = list(server.client().chat.completions.create(model="thought", messages=ASK, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                                          stream=True))
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices) == thought
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    # "none" goes on to the upstream, whose template turns its thinking off.
    plain = server.client().chat.completions.create(model="thought", messages=ASK, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                                    reasoning_effort="none")
    assert plain.choices[0].message.content and "reasoning_content" not in (plain.choices[0].message.model_extra or {})


@pytest.mark.parametrize("model", ["scripted", "vllm"])
def test_either_name_for_an_upstreams_reasoning_is_split_from_its_answer(gateway: tuple[Server, ScriptedUpstream], model: str) -> None:
    server, _ = gateway
    whole = server.client().chat.completions.create(model=model, messages=ASK)  # type: ignore[arg-type]
    message = whole.choices[0].message
    assert message.content == "It is 4." and (message.model_extra or {})["reasoning_content"] == "".join(THOUGHT)
    # The upstream's own count where it gives one; else each chunk the split read inside (the one that ends it too).
    assert whole.usage is not None and whole.usage.completion_tokens_details.reasoning_tokens == (  # type: ignore[union-attr]
        len(THOUGHT) if model == "scripted" else len(THOUGHT) + 1)
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    blocks = client.messages.create(model=model, max_tokens=64, messages=ASK).content  # type: ignore[arg-type]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks] == [
        ("thinking", "".join(THOUGHT)), ("text", "It is 4.")]


def test_a_routed_answer_keeps_its_reasoning_whole_and_replayed(gateway: tuple[Server, ScriptedUpstream]) -> None:
    server, _ = gateway
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "auto", "messages": ASK}, timeout=60)
    assert whole.status_code == 200 and whole.headers["x-route-model"] == "scripted", whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == "It is 4." and message["reasoning_content"] == "".join(THOUGHT)
    streamed = _sse(httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "auto", "messages": ASK, "stream": True},
                               timeout=60))
    deltas = [c["choices"][0]["delta"] for c in streamed if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "".join(THOUGHT)
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])  # the reasoning comes first
