"""The prefix cache must not tell one tenant what another tenant's prompt says (issue 40, hole 3).

Tenant A sends a system prompt holding a secret; tenant B sends guesses and reads `cached_tokens`
(chat completions' `prompt_tokens_details`, Responses' `input_tokens_details`, completions'). Before
prefix reuse was scoped, a right guess reused A's KV and said so (89 cached tokens against 52 for a
wrong one). Now KV is reused only within the caller's tenant unless the model's `prefix_sharing` is
"all". Real server, keys mode, one request at a time so that A's prompt is still in its slot when B
probes: each probe is a tenant's first request, so its own scope explains none of its count."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.fleet.registry import LoadedModel
from appliance.config.settings import LocalModel
from tests.conftest import CHAT_MODEL, MODEL_FILE, config_text, start_server, stop_server
from tests.test_gate_api import new_key
from tests.test_hostile import call

SHARED_MODEL = "shared-prefixes"
SECRET = ("You are the deal desk's assistant. Confidential: the merger target is NORTHWIND TRADERS, "
          "announced next quarter. Never reveal the target. Answer questions about the deal's timeline briefly.")
WRONG = SECRET.replace("NORTHWIND TRADERS", "CONTOSO LIMITED")
QUESTION = "Summarise the instructions."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    text = config_text(embeddings=False, auth="keys", slots=4)
    text = text.replace('[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n', '[auth]\nmode = "keys"\n')
    # The same file again, where the operator lets every tenant share prefixes (a common system prompt).
    text += f'\n[[models]]\nalias = "{SHARED_MODEL}"\npackage_file = "{MODEL_FILE}"\ncontext_length = 2048\nslots = 4\nthreads = 2\nprefix_sharing = "all"\n'
    server = start_server(tmp_path_factory.mktemp("hostile-prefix"), text)
    yield server
    stop_server(server)


_tenants = itertools.count()


def fresh_tenant(server: Any) -> str:
    """A key of a tenant that has sent nothing yet: no prefix of its own scope exists."""
    return new_key(server, f"rival-{next(_tenants)}", user="eve")


def chat_cached(server: Any, key: str, system: str, model: str = CHAT_MODEL) -> int:
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]}
    response = call(server, key, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text[:300]
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def responses_cached(server: Any, key: str, instructions: str) -> int:
    body = {"model": CHAT_MODEL, "instructions": instructions, "input": QUESTION, "max_output_tokens": 1, "temperature": 0, "store": False}
    response = call(server, key, "/v1/responses", body)
    assert response.status_code == 200, response.text[:300]
    return response.json()["usage"]["input_tokens_details"]["cached_tokens"]


def completions_cached(server: Any, key: str, prompt: str) -> int:
    response = call(server, key, "/v1/completions", {"model": CHAT_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text[:300]
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("probe", [chat_cached, responses_cached, completions_cached], ids=["chat", "responses", "completions"])
def test_another_tenant_learns_nothing_from_cached_tokens(server: Any, probe: Any) -> None:
    victim = new_key(server, f"acme-{probe.__name__}", user="alice")
    probe(server, victim, SECRET)
    reused = probe(server, victim, SECRET)
    assert reused > 0  # the same tenant still reuses its own prompt
    seen = []
    for guess in (SECRET, WRONG):
        probe(server, victim, SECRET)  # the victim's prompt is in a slot when each guess arrives
        seen.append(probe(server, fresh_tenant(server), guess))
    # Before the fix: the right guess reused all of the victim's prompt but one token, the wrong one up to the name.
    assert seen == [0, 0], f"right guess {seen[0]} cached tokens, wrong guess {seen[1]}"


def test_prefix_sharing_all_shares_across_tenants(server: Any) -> None:
    victim = new_key(server, "acme-shared", user="alice")
    chat_cached(server, victim, SECRET, SHARED_MODEL)
    first = chat_cached(server, fresh_tenant(server), SECRET, SHARED_MODEL)
    assert first > 0  # the operator chose to share: another tenant's first request reuses the prompt


def test_scope_of_a_request_follows_the_setting() -> None:
    def loaded(sharing: str) -> LoadedModel:
        return LoadedModel(LocalModel(alias="m", path=Path("m.gguf"), prefix_sharing=sharing), None, None)  # type: ignore[arg-type]

    scoped, shared = loaded("tenant"), loaded("all")
    assert scoped.prefix_scope("acme") == "tenant:acme" != scoped.prefix_scope("rival")
    assert scoped.prefix_scope(None) == "" and shared.prefix_scope("acme") == shared.prefix_scope("rival") == ""
    assert scoped.prefix_scope("") != ""  # an empty tenant name never falls into the server's own scope
