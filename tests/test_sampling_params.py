"""logit_bias, frequency/presence penalties and n > 1 through real HTTP, the official SDK and the
bundled model (the adjustments themselves: tests/test_logit_adjust.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, MODEL_FILE, Server, config_text, start_server, stop_server

REPETITIVE = "What is the capital of France?"  # the bundled model's greedy answer repeats itself
STORY = "Tell me a short story."


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    route = f'\n[[routes]]\nalias = "auto"\ntiers = ["{CHAT_MODEL}"]\n'
    server = start_server(tmp_path_factory.mktemp("sampling"), config_text(embeddings=False, slots=4) + route)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return srv.client()


@pytest.fixture(scope="module")
def vocab() -> Iterator[object]:
    from appliance.fleet.files import package_file
    from engines.llamacpp.runtime import Model

    model = Model(package_file(MODEL_FILE), vocab_only=True)
    yield model
    model.close()


def chat(client: openai.OpenAI, content: str, **kwargs: object) -> openai.types.chat.ChatCompletion:
    kwargs.setdefault("max_tokens", 30)
    kwargs.setdefault("model", CHAT_MODEL)
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **kwargs)  # type: ignore[call-overload]


def text(response: openai.types.chat.ChatCompletion, index: int = 0) -> str:
    return response.choices[index].message.content or ""


def test_a_full_positive_bias_forces_its_token(client: openai.OpenAI, vocab: object) -> None:
    (token,) = vocab.tokenize(" Paris", add_special=False, parse_special=False)  # type: ignore[attr-defined]
    forced = chat(client, "Hi", temperature=0, max_tokens=5, logit_bias={str(token): 100})
    assert text(forced) == " Paris" * 5
    assert forced.usage is not None and forced.usage.completion_tokens == 5


def test_a_full_negative_bias_bans_a_token_the_greedy_answer_had(client: openai.OpenAI, vocab: object) -> None:
    greedy = chat(client, REPETITIVE, temperature=0, logprobs=True)
    assert greedy.choices[0].logprobs is not None and greedy.choices[0].logprobs.content
    first = bytes(greedy.choices[0].logprobs.content[0].bytes or [])
    (banned,) = [t for t in range(vocab.n_vocab) if vocab.piece(t) == first][:1]  # type: ignore[attr-defined]
    assert vocab.piece(banned) == first  # type: ignore[attr-defined]
    again = chat(client, REPETITIVE, temperature=0, logprobs=True, logit_bias={str(banned): -100})
    assert again.choices[0].logprobs is not None
    assert all(bytes(t.bytes or []) != first for t in again.choices[0].logprobs.content or [])
    assert text(again) != text(greedy)


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_change_a_repetitive_greedy_answer_deterministically(client: openai.OpenAI, penalty: str) -> None:
    plain = text(chat(client, REPETITIVE, temperature=0))
    words = Counter(plain.split())
    assert max(words.values()) >= 3, plain  # the premise: greedy repeats itself
    first = text(chat(client, REPETITIVE, temperature=0, **{penalty: 2.0}))
    second = text(chat(client, REPETITIVE, temperature=0, **{penalty: 2.0}))
    assert first == second
    assert first != plain
    assert max(Counter(first.split()).values()) < max(words.values())


def test_top_k_of_one_draws_the_greedy_answer_at_any_temperature(client: openai.OpenAI) -> None:
    greedy = text(chat(client, STORY, max_tokens=24, temperature=0))
    drawn = [text(chat(client, STORY, max_tokens=24, temperature=1.5, seed=seed, extra_body={"top_k": k})) for seed in (1, 2, 3) for k in (1, 0)]
    assert drawn[0::2] == [greedy] * 3  # top_k 1: the likeliest token every step
    assert len(set(drawn[1::2])) > 1  # top_k 0 (off): the same seeds draw other answers


def test_n_choices_follow_the_seed_stream_and_add_up(client: openai.OpenAI) -> None:
    many = chat(client, STORY, temperature=1, seed=7, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [text(many, i) for i in range(3)]
    assert len(set(texts)) == 3  # sampled apart
    again = chat(client, STORY, temperature=1, seed=7, n=3)
    assert [text(again, i) for i in range(3)] == texts  # reproducible
    singles = [chat(client, STORY, temperature=1, seed=7 + i) for i in range(3)]
    assert [text(s) for s in singles] == texts  # choice i is the request with seed + i
    assert many.usage is not None
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # type: ignore[union-attr]
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)  # type: ignore[union-attr]
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens


def test_greedy_choices_are_identical(client: openai.OpenAI) -> None:
    both = chat(client, STORY, temperature=0, n=2)
    assert text(both, 0) == text(both, 1) == text(chat(client, STORY, temperature=0))


def test_streamed_choices_assemble_by_index(client: openai.OpenAI) -> None:
    whole = chat(client, STORY, temperature=1, seed=11, n=2)
    parts: dict[int, list[str]] = {}
    finishes: dict[int, str | None] = {}
    usage = None
    with client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": STORY}], max_tokens=30,
                                        temperature=1, seed=11, n=2, stream=True, stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                parts.setdefault(choice.index, []).append(choice.delta.content or "")
                if choice.finish_reason is not None:
                    finishes[choice.index] = choice.finish_reason
            usage = chunk.usage or usage
    assert {i: "".join(p) for i, p in parts.items()} == {0: text(whole, 0), 1: text(whole, 1)}
    assert finishes == {0: whole.choices[0].finish_reason, 1: whole.choices[1].finish_reason}
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_completions_take_n_and_penalties(client: openai.OpenAI) -> None:
    done = client.completions.create(model=CHAT_MODEL, prompt="Once upon a time", max_tokens=10, n=2, temperature=1, seed=3,
                                     frequency_penalty=0.5)
    assert [c.index for c in done.choices] == [0, 1] and done.choices[0].text != done.choices[1].text
    single = client.completions.create(model=CHAT_MODEL, prompt="Once upon a time", max_tokens=10, temperature=1, seed=4,
                                       frequency_penalty=0.5)
    assert single.choices[0].text == done.choices[1].text


def test_choices_share_the_prompts_prefill(srv: Server, client: openai.OpenAI) -> None:
    def copied() -> float:
        metrics = httpx.get(f"{srv.base_url}/metrics").text
        line = next(x for x in metrics.splitlines() if "prefix" in x and 'source="copy"' in x and not x.startswith("#"))
        return float(line.rsplit(" ", 1)[1])

    srv.wait_idle()
    before = copied()
    long_prompt = "Here are the facts. " + " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(40))
    response = chat(client, long_prompt + " Which facts are there?", temperature=0, n=3, max_tokens=3)
    assert response.usage is not None
    # Choices 1 and 2 copy the prompt's KV from the slot of choice 0 instead of computing it again.
    assert copied() - before >= 2 * (response.usage.prompt_tokens - 64)


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
])
def test_bad_sampling_fields_are_400s_naming_them(srv: Server, body: dict, param: str) -> None:
    for path, base in (("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}), ("completions", {"prompt": "Hi"})):
        response = httpx.post(f"{srv.base_url}/v1/{path}", json={"model": CHAT_MODEL, "max_tokens": 2, **base, **body}, timeout=30)
        assert response.status_code == 400, response.text
        assert (response.json()["error"]["param"] or "").split(".")[0].split("[")[0] == param, response.text


def test_a_route_answers_one_choice_in_its_own_vocabulary(srv: Server, client: openai.OpenAI) -> None:
    for body, param in (({"n": 2}, "n"), ({"logit_bias": {"5": 1}}, "logit_bias")):
        response = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=30,
                              json={"model": "auto", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    routed = chat(client, REPETITIVE, model="auto", temperature=0, frequency_penalty=2.0)
    assert text(routed) == text(chat(client, REPETITIVE, temperature=0, frequency_penalty=2.0))
