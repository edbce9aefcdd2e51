"""A call's n choices, without IO: each choice's request, and the whole answer's finish."""

from __future__ import annotations

from appliance.pipeline.choices import choice_request, total_finish
from engines.interface import FinishEvent, GenerationRequest, SamplingParams, Usage


def test_choice_i_is_the_request_with_its_own_id_and_seed_plus_i() -> None:
    request = GenerationRequest("r", (1, 2), 8, SamplingParams(seed=2**63 - 1))
    assert choice_request(request, 0) is request
    second = choice_request(request, 1)
    assert second.id == "r.1" and second.sampling.seed == -(2**63)  # wrapped into 64 bits
    unseeded = choice_request(GenerationRequest("r", (1,), 8), 2)
    assert unseeded.id == "r.2" and unseeded.sampling.seed is None


def test_the_whole_answer_counts_the_prompt_once_and_every_completion() -> None:
    a = FinishEvent("stop", Usage(10, 3, 4), time_to_first_token_s=0.2, total_time_s=1.0, inter_token_s=(0.1,))
    b = FinishEvent("length", Usage(10, 5, 4), time_to_first_token_s=0.1, total_time_s=2.0)
    assert total_finish({0: a}, 1, 3) is a  # one choice's finish is its own
    total = total_finish({1: b, 0: a}, 2, 8)
    assert total is not None and total.reason == "stop" and total.usage == Usage(10, 8, 4)
    assert (total.time_to_first_token_s, total.total_time_s, total.inter_token_s) == (0.1, 2.0, None)


def test_an_unfinished_answer_has_no_finish_until_a_choice_fails() -> None:
    a = FinishEvent("stop", Usage(10, 3))
    assert total_finish({}, 1, 0) is None and total_finish({0: a}, 2, 5) is None  # a client gone: settled on progress
    error = FinishEvent("error", Usage(10, 1), error="boom")
    failed = total_finish({0: a, 1: error}, 3, 7)  # choice 2 was cut: charged for what every choice generated
    assert failed is not None and failed.reason == "error" and failed.error == "boom" and failed.usage.completion_tokens == 7
    whole = total_finish({0: error, 1: a}, 2, 99)  # every choice ended: their own counts
    assert whole is not None and whole.reason == "error" and whole.usage.completion_tokens == 4
