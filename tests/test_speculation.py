"""Speculative decoding: the pure parts (prompt lookup, draft sizing), then the real engine over
HTTP, where greedy output must be the same token for token with and without speculation."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.fleet.files import package_file
from engines.speculation import Acceptance, NgramLookup, StepCost, draft_length, expected_tokens
from tests.conftest import CHAT_MODEL, INVARIANT, MODEL_FILE, Server, config_text, start_server, stop_server
from tests.gguf_files import rewrite_gguf

# ---- pure ---------------------------------------------------------------------------------------


def brute_force_draft(tokens: list[int], k: int, n_max: int = 3, n_min: int = 2) -> tuple[int, ...]:
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 8))
def test_prompt_lookup_proposes_what_followed_the_latest_match(tokens, k):
    lookup = NgramLookup(tuple(tokens))
    assert lookup.draft(k) == brute_force_draft(tokens, k)


def test_prompt_lookup_finds_the_continuation_of_an_edit():
    source = [10, 11, 12, 13, 14, 15, 16, 17]
    lookup = NgramLookup(tuple(source + [99, 12, 13]))
    assert lookup.draft(4) == (14, 15, 16, 17)
    lookup.append(14)
    assert lookup.draft(2) == (15, 16)


def test_draft_length_pays_only_where_it_should():
    # a big model with cheap verification (memory-bound decode), in seconds for 1..9 tokens
    cheap_verify = StepCost(tuple(0.070 + 0.008 * n for n in range(9)))
    # what this machine measures for the 1.5B target: 4 tokens cost 2.5 steps, 9 cost 7
    measured = StepCost((0.039, 0.065, 0.080, 0.096, 0.150, 0.190, 0.230, 0.250, 0.273))
    linear = StepCost(tuple(0.006 * n for n in range(1, 10)))  # the bundled model: no batch discount
    assert draft_length(0.9, cheap_verify, 1, 8) >= 6
    assert draft_length(0.9, cheap_verify, 1, 8, draft_cost=0.1) == 0  # drafting slower than decoding
    assert 2 <= draft_length(0.9, measured, 1, 8) <= 4  # the cheap region of the curve
    assert draft_length(0.9, measured, 1, 8, draft_cost=0.024) == 0  # the 0.5B draft costs too much here
    assert draft_length(0.95, linear, 1, 8) == 0
    assert draft_length(0.5, cheap_verify, 8, 8) <= draft_length(0.5, cheap_verify, 1, 8)
    lengths = [draft_length(a / 10, cheap_verify, 1, 16) for a in range(10)]
    assert lengths == sorted(lengths)  # more acceptance never drafts less
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    assert measured(12) == pytest.approx(0.273 + 3 * 0.023)  # past the table, the last slope
    # a draft model that must first read a 500-token prompt: worth it only for a long answer
    assert draft_length(0.95, cheap_verify, 1, 8, draft_cost=0.005, setup_s=500 * 0.01, tokens_left=8) == 0
    assert draft_length(0.95, cheap_verify, 1, 8, draft_cost=0.005, setup_s=500 * 0.01, tokens_left=2000) > 0


def test_step_costs_are_monotone_and_follow_what_steps_take():
    noisy = StepCost((0.040, 0.090, 0.060, 0.150))
    assert [noisy(n) for n in range(1, 5)] == [0.040, 0.090, 0.090, 0.150]  # a low sample is noise
    assert noisy.observe(2, 0.100).seconds[1] == pytest.approx(0.095)  # its first sample since load: the mean
    often = noisy
    for _ in range(20):
        often = often.observe(1, 0.050)
    assert often.observe(1, 0.100).seconds[0] == pytest.approx(0.060, abs=1e-3)  # then a moving average
    assert noisy.observe(9, 0.5) is noisy and noisy.observe(2, 0.0) is noisy
    # Verify steps looked cheap at load; what they really take here (2.2 to 6.5 one-token steps)
    # turns speculation off after a few of them, at an acceptance a story gets.
    looked = StepCost((0.043, 0.050, 0.056, 0.062, 0.070))
    real = (0.043, 0.096, 0.121, 0.151, 0.191)
    assert draft_length(0.6, looked, 1, 4) > 0
    cost = looked
    for _ in range(10):
        k = draft_length(0.6, cost, 1, 4)
        if k == 0:
            break
        cost = cost.observe(1 + k, real[k])
    assert draft_length(0.6, cost, 1, 4) == 0


def test_a_new_request_starts_from_the_models_acceptance_lightly():
    model_wide = Acceptance(accepted=80, rejected=20)
    start = model_wide.prior()
    assert start.rate == pytest.approx(model_wide.rate, abs=0.15)
    worse = start
    for _ in range(3):
        worse = worse.update(drafted=4, kept=0)
    assert worse.rate < 0.4  # three rejected drafts outweigh it
    # little evidence is held cautiously; much evidence hardly moves the cautious rate
    assert start.cautious < start.rate - 0.15
    assert model_wide.rate - model_wide.cautious < 0.05


def test_acceptance_forgets_old_evidence():
    a = Acceptance()
    assert a.rate == 0.5
    for _ in range(30):
        a = a.update(drafted=4, kept=4)
    assert a.rate > 0.95
    for _ in range(30):
        a = a.update(drafted=4, kept=0)
    assert a.rate < 0.25


# ---- the real engine ----------------------------------------------------------------------------

EDIT = (
    "Rewrite this function, renaming the variable total to subtotal and changing nothing else:\n\n"
    "def price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.count\n"
    "    if total > 100:\n        total = total * 0.9\n    return round(total, 2)\n"
)
PROMPTS = [EDIT, "Write a short poem about a lighthouse.", "List the planets of the solar system in order."]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    draft = f'\n[[models]]\nalias = "draft"\nkind = "draft"\npackage_file = "{MODEL_FILE}"\n'
    configs = {
        "plain": config_text(slots=4, embeddings=False, model_extra=INVARIANT + 'speculation = "off"'),
        "lookup": config_text(slots=4, embeddings=False, model_extra=INVARIANT + 'speculation = "prompt_lookup"\nspeculation_fixed_tokens = 4'),
        "draft": config_text(slots=4, embeddings=False, model_extra=INVARIANT + 'draft_model = "draft"\nspeculation_fixed_tokens = 3') + draft,
    }
    started: dict[str, Server] = {}
    try:
        for name, text in configs.items():
            started[name] = start_server(tmp_path_factory.mktemp(name), text)
        yield started
    finally:
        for srv in started.values():
            stop_server(srv)


async def ask(server: Server, prompt: str, max_tokens: int = 120) -> str:
    async with server.async_client(timeout=600) as client:
        r = await client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or ""


def counters(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^appliance_speculation_(\w+?)(?:_total)?\{[^}]*\} (\S+)$", text, re.M)}


def test_greedy_output_is_identical_with_and_without_speculation(servers: dict[str, Server]) -> None:
    async def alone(server: Server) -> list[str]:
        return [await ask(server, p) for p in PROMPTS]

    plain = asyncio.run(alone(servers["plain"]))
    assert all(plain)
    for name in ("lookup", "draft"):
        assert asyncio.run(alone(servers[name])) == plain, name
    lookup, draft = counters(servers["lookup"]), counters(servers["draft"])
    # prompt lookup drafts from the function it is asked to rewrite, and much of it is kept
    assert lookup["drafted_tokens"] > 50 and lookup["accepted_tokens"] > 25
    # the model drafting for itself agrees with itself nearly always
    assert draft["drafted_tokens"] > 100 and draft["acceptance_rate"] > 0.9
    assert "drafted_tokens" not in counters(servers["plain"])


def test_speculating_slots_share_the_batch_with_the_same_text(servers: dict[str, Server]) -> None:
    async def together(server: Server) -> list[str]:
        return list(await asyncio.gather(*(ask(server, p, 80) for p in PROMPTS + PROMPTS[:1])))

    plain = asyncio.run(together(servers["plain"]))
    for name in ("lookup", "draft"):
        assert asyncio.run(together(servers[name])) == plain, name


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    source = package_file(MODEL_FILE)

    def rename_a_token(key: str, value: object) -> object:
        if key == "tokenizer.ggml.tokens":
            tokens = list(value)  # type: ignore[call-overload]
            tokens[1000] = "zzzz-not-in-the-target"
            return tokens
        return value

    other = rewrite_gguf(source, tmp_path / "other-vocab.gguf", rename_a_token)
    text = config_text(slots=2, embeddings=False, model_extra='draft_model = "other"') + f'\n[[models]]\nalias = "other"\nkind = "draft"\npath = "{other}"\n'
    with pytest.raises(RuntimeError) as failure:
        start_server(tmp_path / "srv", text)
    message = str(failure.value)
    assert "other-vocab.gguf cannot draft for SmolLM2-135M-Instruct.Q4_1.gguf" in message
    assert "token 1000" in message
