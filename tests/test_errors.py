"""Every bad request gets OpenAI's error envelope, the right status and the offending param."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, EMBED_MODEL, Server

HELLO = [{"role": "user", "content": "Hi"}]


def post(server: Server, path: str, body: object = None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def envelope(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": CHAT_MODEL, "messages": HELLO, "max_tokens": "many"}, "max_tokens"),
        ({"model": CHAT_MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"model": CHAT_MODEL}, None),
        ({"model": CHAT_MODEL, "messages": []}, "messages"),
        ({"model": CHAT_MODEL, "messages": HELLO, "temperature": 3}, "temperature"),
        ({"model": CHAT_MODEL, "messages": HELLO, "top_p": 0}, "top_p"),
        ({"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ({"model": CHAT_MODEL, "messages": HELLO, "n": 9}, "n"),  # more choices than MAX_CHOICES
        ({"model": CHAT_MODEL, "messages": HELLO, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),  # would change the answer
        ({"model": CHAT_MODEL, "messages": HELLO, "modalities": ["text", "audio"]}, "modalities"),
        ({"model": CHAT_MODEL, "messages": HELLO, "web_search_options": {}}, "web_search_options"),
        ({"model": CHAT_MODEL, "messages": HELLO, "reasoning_effort": "extreme"}, "reasoning_effort"),  # not an effort OpenAI names
        ({"model": CHAT_MODEL, "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": CHAT_MODEL, "messages": HELLO, "top_logprobs": 2}, "top_logprobs"),
        ({"model": CHAT_MODEL, "messages": HELLO, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"model": CHAT_MODEL, "messages": HELLO, "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"model": CHAT_MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
         "tools[0].function.parameters"),
        ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
        ({"model": EMBED_MODEL, "messages": HELLO}, "model"),
    ],
)
def test_invalid_chat_body_is_400_naming_param(server: Server, body: dict, param: str | None) -> None:
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = envelope(r)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is None:
        assert "messages" in error["message"]


def test_invalid_completion_and_embedding_bodies(server: Server) -> None:
    assert envelope(post(server, "/v1/completions", {"model": CHAT_MODEL, "prompt": ""}))["param"] == "prompt"
    assert envelope(post(server, "/v1/completions", {"model": CHAT_MODEL, "prompt": [1, "a"]}))["param"] == "prompt"
    assert envelope(post(server, "/v1/completions", {"model": CHAT_MODEL, "prompt": [10**9]}))["param"] == "prompt"
    assert envelope(post(server, "/v1/embeddings", {"model": EMBED_MODEL, "input": ""}))["param"] == "input"
    assert envelope(post(server, "/v1/embeddings", {"model": CHAT_MODEL, "input": "x"}))["param"] == "model"


def test_malformed_json_is_400(server: Server) -> None:
    r = post(server, "/v1/chat/completions", content=b'{"model": ')
    assert r.status_code == 400
    assert envelope(r)["code"] == "invalid_json"
    r = post(server, "/v1/chat/completions", content=b"")
    assert r.status_code == 400


def test_oversized_body_is_413(server: Server) -> None:
    huge = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = post(server, "/v1/chat/completions", huge)
    assert r.status_code == 413
    assert envelope(r)["code"] == "request_too_large"


def test_context_length_is_an_error_never_truncation(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=5000)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "2048" in info.value.body["message"]
    long_prompt = "word " * 2100
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=CHAT_MODEL, prompt=long_prompt)
    assert info.value.body["code"] == "context_length_exceeded"
    server.wait_idle()


def test_unknown_route_and_method(server: Server) -> None:
    r = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert r.status_code == 404
    envelope(r)
    r = httpx.get(f"{server.base_url}/v1/chat/completions")
    assert r.status_code == 405
    envelope(r)
