"""The OpenAI-compatible API, through the official SDK, against the real bundled model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, EMBED_MODEL, Server

HELLO = [{"role": "user", "content": "Say hello to the world."}]


def test_models_list(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert ids == {CHAT_MODEL, EMBED_MODEL}
    assert client.models.retrieve(CHAT_MODEL).id == CHAT_MODEL


def test_chat_non_streamed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 5
    assert 1 <= r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.model == CHAT_MODEL


def test_chat_streamed_matches_non_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(
        model=CHAT_MODEL, messages=HELLO, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_status_is_200_streamed_or_not(server: Server) -> None:
    body = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": CHAT_MODEL, "prompt": "a", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
    r = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "a"}, timeout=60)
    assert r.status_code == 200


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=4, temperature=0, stream=True))
    assert all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_max_completion_tokens_limits_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                                       max_completion_tokens=7, temperature=0)
    assert r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=CHAT_MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text
    assert r.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=CHAT_MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    echoed = client.completions.create(model=CHAT_MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + r.choices[0].text


def test_stop_string_is_excluded(client: openai.OpenAI) -> None:
    prompt = "Count from one to ten in words, separated by commas: one, two,"
    free = client.completions.create(model=CHAT_MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    assert " five" in free, free  # the premise of the test: the model does count
    r = client.completions.create(model=CHAT_MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[" five"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(" five")]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=CHAT_MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[" five"], stream=True))
    assert streamed == r.choices[0].text


def test_seed_reproducible_sampling(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        return client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=24, temperature=1.0, seed=seed).choices[0].message.content

    first = run(1234)
    assert run(1234) == first
    assert len({run(s) for s in (1, 2, 3, 4)} | {first}) > 1


def test_json_object_output_parses(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=CHAT_MODEL, max_tokens=96, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object describing a cat with fields name and age."}],
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 30},
                       "color": {"enum": ["black", "white", "orange"]}},
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=CHAT_MODEL, max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}},
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
    )
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name", "age", "color"}
    assert isinstance(data["name"], str) and len(data["name"]) <= 20
    assert isinstance(data["age"], int) and 0 <= data["age"] <= 30
    assert data["color"] in ("black", "white", "orange")


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens or len(content) == r.usage.completion_tokens - 1  # minus an end token
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for token in content:
        assert token.logprob <= 0.0
        assert len(token.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    streamed = [c for c in client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                          logprobs=True, top_logprobs=2, stream=True) if c.choices and c.choices[0].logprobs]
    assert [c.choices[0].logprobs.content[0].token for c in streamed] == [t.token for t in content]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=CHAT_MODEL, prompt="One, two, three,", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_embeddings(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model=EMBED_MODEL, input=["a cat sat on the mat", "quantum field theory"])
    assert len(r.data) == 2
    a, b = (d.embedding for d in r.data)
    assert len(a) == len(b) == 576
    assert a != b
    again = client.embeddings.create(model=EMBED_MODEL, input="a cat sat on the mat").data[0].embedding
    assert again == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert r.usage.prompt_tokens > 4


def test_health_and_metrics(server: Server, client: openai.OpenAI) -> None:
    client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=3, temperature=0)
    health = server.health()
    assert health["status"] == "ok"
    assert health["models"][CHAT_MODEL]["slots_total"] == 8
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("appliance_requests_total", "appliance_prompt_tokens_total", "appliance_completion_tokens_total",
                 "appliance_time_to_first_token_seconds_bucket", "appliance_decode_tokens_per_second_bucket",
                 "appliance_slots_busy", "appliance_queue_depth"):
        assert name in text, name
    assert f'appliance_requests_total{{endpoint="chat",model="{CHAT_MODEL}",status="ok"}}' in text


def test_repeated_prefix_is_served_from_slot_kv_with_the_same_output(client: openai.OpenAI, server: Server) -> None:
    question = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    first = client.chat.completions.create(model=CHAT_MODEL, messages=question, max_tokens=40, temperature=0)
    again = client.chat.completions.create(model=CHAT_MODEL, messages=question, max_tokens=40, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert f'appliance_prompt_tokens_cached_total{{model="{CHAT_MODEL}"}}' in metrics
