"""Ollama's API through the official `ollama` Python client (and LangChain's ChatOllama) against a
real server on the bundled model: the same call path as chat, Ollama's NDJSON wire, its listings
and its error body."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.conftest import CHAT_MODEL, EMBED_MODEL, Server, config_text, start_server, stop_server
from tests.test_gate_api import new_key

TAGGED = f"{CHAT_MODEL}:latest"
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("ollama"), config_text(slots=2))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(srv: Server) -> ollama.Client:
    return ollama.Client(host=srv.base_url, timeout=120)


def test_the_server_says_it_is_ollama_and_lists_its_models(srv: Server, client: ollama.Client) -> None:
    assert httpx.get(srv.base_url).text == "Ollama is running"
    major, minor, patch = (int(x) for x in httpx.get(f"{srv.base_url}/api/version").json()["version"].split("."))
    assert (major, minor, patch) >= (0, 6, 4)  # what VS Code's Ollama provider asks for
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {TAGGED, f"{EMBED_MODEL}:latest"}
    details = listed[TAGGED].details
    assert details is not None and (details.format, details.family, details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert listed[TAGGED].size is not None and listed[TAGGED].size > 50_000_000


def test_show_gives_what_model_pickers_read(client: ollama.Client) -> None:
    shown = client.show(TAGGED)
    assert shown.capabilities is not None and {"completion", "tools"} <= set(shown.capabilities)
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == 2048
    assert shown.template and "<|im_start|>" in shown.template
    assert "embedding" in (client.show(EMBED_MODEL).capabilities or [])
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error


def test_chat_answers_as_chat_does_whole_and_streamed(srv: Server, client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 16}
    whole = client.chat(model=TAGGED, messages=ASK, options=options)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.prompt_eval_count and whole.prompt_eval_count > 5 and whole.eval_count and 1 <= whole.eval_count <= 16
    assert whole.total_duration and whole.total_duration > 0
    openai_side = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x").chat.completions.create(
        model=CHAT_MODEL, messages=ASK, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    assert whole.message.content == openai_side.choices[0].message.content
    pieces = list(client.chat(model=TAGGED, messages=ASK, options=options, stream=True))
    assert all(not p.done for p in pieces[:-1]) and pieces[-1].done and pieces[-1].eval_count == whole.eval_count
    assert "".join(p.message.content or "" for p in pieces) == whole.message.content
    with httpx.stream("POST", f"{srv.base_url}/api/chat", json={"model": TAGGED, "messages": ASK, "options": options}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and len(lines) > 2  # a stream by default, as Ollama's


def test_generate_uses_the_chat_template_and_raw_does_not(client: ollama.Client) -> None:
    told = client.generate(model=TAGGED, prompt="What is 2 + 2?", system="Answer with one word.", options={"temperature": 0, "num_predict": 8})
    assert told.done and told.response.strip()
    streamed = "".join(p.response for p in client.generate(model=TAGGED, prompt="What is 2 + 2?", system="Answer with one word.",
                                                           options={"temperature": 0, "num_predict": 8}, stream=True))
    assert streamed == told.response
    raw = client.generate(model=TAGGED, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 4})
    assert raw.response and raw.prompt_eval_count is not None and raw.prompt_eval_count < told.prompt_eval_count  # type: ignore[operator]


def test_format_json_and_a_schema_are_enforced(client: ollama.Client) -> None:
    as_json = client.chat(model=TAGGED, messages=[{"role": "user", "content": "Give a cat's name and age in JSON."}], format="json",
                          options={"temperature": 0, "num_predict": 200})
    assert isinstance(json.loads(as_json.message.content or ""), dict)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}}, "required": ["colour"]}
    shaped = client.chat(model=TAGGED, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 30})
    assert json.loads(shaped.message.content or "")["colour"] in ("red", "green", "blue")


def test_a_tool_turn_is_answered_and_forced_calls_come_back_as_ollama_writes_them(client: ollama.Client) -> None:
    tool = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
    history = [{"role": "user", "content": "What is 2 + 3?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
               {"role": "tool", "content": "5", "tool_name": "add"}]
    after = client.chat(model=TAGGED, messages=history, tools=[tool], options={"temperature": 0, "num_predict": 12})
    assert after.done and after.prompt_eval_count and after.prompt_eval_count > 20
    with pytest.raises(ollama.ResponseError) as orphan:
        client.chat(model=TAGGED, messages=[{"role": "tool", "content": "5", "tool_name": "add"}], tools=[tool])
    assert orphan.value.status_code == 400 and "answers no earlier tool call" in orphan.value.error


def test_embed_and_the_older_embeddings_match_openais(srv: Server, client: ollama.Client) -> None:
    texts = ["a red apple", "the stock market"]
    got = client.embed(model=EMBED_MODEL, input=texts)
    assert len(got.embeddings) == 2 and got.prompt_eval_count and got.prompt_eval_count > 2
    theirs = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x").embeddings.create(model=EMBED_MODEL, input=texts)
    assert np.allclose(np.array(got.embeddings), np.array([d.embedding for d in theirs.data]), atol=1e-5)
    one = client.embeddings(model=EMBED_MODEL, prompt=texts[0])
    assert np.allclose(one.embedding, got.embeddings[0], atol=1e-5)


def test_an_empty_request_loads_and_ps_lists_what_is_in_memory(client: ollama.Client) -> None:
    loaded = client.chat(model=TAGGED, messages=[])
    assert loaded.done and loaded.done_reason == "load"
    running = {m.model for m in client.ps().models}
    assert TAGGED in running


@pytest.mark.parametrize(("body", "says"), [
    ({"model": "no-such-model", "messages": ASK}, "does not exist"),
    ({"model": TAGGED, "messages": ASK, "options": {"mirostat": 2}}, "options.mirostat"),
    ({"model": TAGGED, "messages": [{"role": "user", "content": "hi", "images": ["AA=="]}]}, "images are not supported"),
    ({"model": TAGGED, "messages": ASK, "keep_alive": "soon"}, "keep_alive"),
    ({"model": TAGGED, "messages": ASK, "format": "yaml"}, "format"),
    ({"model": TAGGED, "messages": ASK, "think": "max"}, "think: true, false"),
    ({"model": TAGGED, "messages": "hi"}, "messages"),
])
def test_bad_requests_are_refused_in_ollamas_error_body(srv: Server, body: dict, says: str) -> None:
    r = httpx.post(f"{srv.base_url}/api/chat", json={**body, "stream": False}, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert set(r.json()) == {"error"} and says in r.json()["error"]


def test_langchains_chat_ollama_answers(srv: Server) -> None:
    from langchain_ollama import ChatOllama

    reply = ChatOllama(model=TAGGED, base_url=srv.base_url, temperature=0, num_predict=12).invoke("Name a colour.")
    assert isinstance(reply.content, str) and reply.content.strip()


def test_a_keys_mode_box_serves_an_ollama_client_that_sends_a_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_server(tmp_path_factory.mktemp("ollama-keys"), config_text(embeddings=False, auth="keys").replace(
        '[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n', '[auth]\nmode = "keys"\n'))
    try:
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=server.base_url).chat(model=TAGGED, messages=ASK)
        assert refused.value.status_code == 401
        keyed = ollama.Client(host=server.base_url, headers={"Authorization": f"Bearer {new_key(server, 'acme')}"})
        assert keyed.chat(model=TAGGED, messages=ASK, options={"num_predict": 4}).done
        with pytest.raises(ollama.ResponseError) as unload:  # a member may not take the model from everyone
            keyed.chat(model=TAGGED, messages=[], keep_alive=0)
        assert unload.value.status_code == 403
    finally:
        stop_server(server)


def test_pull_copy_and_delete_change_the_fleet_through_the_one_download_path(tmp_path_factory: pytest.TempPathFactory,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.fleet.files import package_file
    from tests.conftest import MODEL_FILE
    from tests.fake_hub import FakeHub

    bundled = package_file(MODEL_FILE)
    with FakeHub({"acme/smol-GGUF/smol.Q4_1.gguf": bundled}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        server = start_server(tmp_path_factory.mktemp("ollama-pull"), config_text(embeddings=False))
        try:
            client = ollama.Client(host=server.base_url, timeout=120)
            with pytest.raises(ollama.ResponseError) as library:  # Ollama's registry is not this box's
                client.pull("llama3.2")
            assert library.value.status_code == 400 and "hf.co/<owner>/<repo>:<file>.gguf" in library.value.error
            progress = list(client.pull("hf.co/acme/smol-GGUF:smol.Q4_1.gguf", stream=True))
            assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
            assert any(p.completed == p.total == bundled.stat().st_size for p in progress)
            assert ("HEAD" in {method for method, _ in hub.requests}) and any("smol.Q4_1.gguf" in path for _, path in hub.requests)
            assert "smol.q4_1:latest" in {m.model for m in client.list().models}
            assert client.chat(model="smol.q4_1", messages=ASK, options={"num_predict": 4}).done
            assert client.copy("smol.q4_1", "smol-copy").status == "success"
            assert "smol-copy:latest" in {m.model for m in client.list().models}
            assert client.chat(model="smol-copy:latest", messages=ASK, options={"num_predict": 4}).done
            assert client.delete("smol-copy").status == "success"
            assert "smol-copy:latest" not in {m.model for m in client.list().models}
            with pytest.raises(ollama.ResponseError) as gone:
                client.delete("smol-copy")
            assert gone.value.status_code == 404
        finally:
            stop_server(server)
