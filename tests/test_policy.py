from policy.pipeline import RequestFacts, Refusal, Route, decide


def test_known_model_routes_to_itself():
    assert decide(RequestFacts("chat", "a"), frozenset({"a", "b"})) == Route("a")


def test_unknown_model_is_refused_as_not_found():
    decision = decide(RequestFacts("chat", "zz"), frozenset({"a"}))
    assert isinstance(decision, Refusal) and (decision.status, decision.param, decision.code) == (404, "model", "model_not_found")
