"""Distillation's collect step end to end: answers produced through the real server (routed and by
name, whole and streamed, through the official client), marked good or bad through
/v1/cache/feedback, from an opted-in tenant and one that is not, one carrying an e-mail address;
then `appliance distill export` keeps exactly the verified, opted-in, personal-data-free ones, and
its held-out part never overlaps training."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import httpx
import openai
import pytest

from appliance.cli.main import build_parser
from policy.programs import PROMPT, program_of, straight_line
from tests.conftest import CHAT_MODEL, MODEL_FILE, Server, config_text, start_server, stop_server
from tests.test_gate_api import cli, new_key

SMALL = "tier-small"
SYSTEM = "Answer in a few words."
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def distill_config() -> str:
    text = config_text(embeddings=False, auth="keys", cache="enabled = true\nsweep_interval_s = 0",
                       extra='[distill]\ntenants = ["acme"]\n')
    text = text.replace('[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n', '[auth]\nmode = "keys"\n')
    return text + f"""
[[models]]
alias = "{SMALL}"
package_file = "{MODEL_FILE}"
context_length = 1024
slots = 2
threads = 2

[[routes]]
alias = "auto"
tiers = ["{SMALL}", "{CHAT_MODEL}"]

[routes.role_floor]
analyst = "frontier"

[routes.role_ceiling]
intern = "small"

[[routes]]
alias = "programs"
tiers = ["{SMALL}", "{CHAT_MODEL}"]
program_families = ["sums"]

[routes.family_tiers]
sums = "{CHAT_MODEL}"
"""


def role_key(server: Server, tenant: str, role: str) -> str:
    out = cli(server, "keys", "create", "--tenant", tenant, "--app", "web", "--user", role, "--role", role)
    return out.strip().splitlines()[-1]


def db(server: Server) -> apsw.Connection:
    return apsw.Connection(str(server.home / "appliance.db"), flags=apsw.SQLITE_OPEN_READONLY)


def wait_for(server: Server, sql: str, count: int, timeout: float = 15.0) -> None:
    """Rows written off the request path (kept answers, cache entries)."""
    deadline = time.monotonic() + timeout
    while db(server).execute(sql).fetchone()[0] < count:
        assert time.monotonic() < deadline, f"fewer than {count} rows: {sql}"
        time.sleep(0.05)


def ask(server: Server, key: str, question: str, model: str = "auto", *, family: str | None = None, stream: bool = False,
        headers: dict[str, str] | None = None, **extra: Any) -> str:
    """Asks through the official client; returns the response id."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    fields: dict[str, Any] = {"stop": ["."], "max_tokens": 32, **extra}
    if family is not None:
        fields["metadata"] = {"family": family}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if stream:
        chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, stream=True, extra_headers=headers,
                                                     **fields))
        return chunks[0].id
    return client.chat.completions.create(model=model, messages=messages, temperature=0, extra_headers=headers, **fields).id


def rate(server: Server, key: str, response_id: str, rating: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/cache/feedback", json={"response_id": response_id, "rating": rating},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    server = start_server(tmp_path_factory.mktemp("distill"), distill_config())
    acme, analyst, intern = new_key(server, "acme"), role_key(server, "acme", "analyst"), role_key(server, "acme", "intern")
    zeta = role_key(server, "zeta", "analyst")
    expected = set()  # the user turns export should keep
    # The frontier tier (the analyst's floor), never rejected: kept; the same prompt again (past the cache) is a duplicate.
    ask(server, analyst, "What is the capital of France?", family="factual")
    ask(server, analyst, "What is the capital of France?", family="factual", headers={"Cache-Control": "no-cache"})
    expected.add("What is the capital of France?")
    # The small tier (the intern's ceiling): kept only once marked good. This one bypasses the cache's store,
    # so the feedback reaches it through the kept answers alone.
    good = ask(server, intern, "Name a fruit", headers={"Cache-Control": "no-store"})
    expected.add("Name a fruit")
    ask(server, intern, "Name a vegetable")  # unconfirmed
    # The frontier, rejected by its caller.
    bad = ask(server, analyst, "Name an animal")
    # The frontier, with personal data in the prompt.
    ask(server, analyst, "My e-mail is anna.berg@example.com. What is two plus two?")
    # A tenant that never opted in: nothing of it is kept, marked good or not.
    stranger = ask(server, zeta, "Name a planet")
    # The route's frontier model asked by name, whole and streamed.
    ask(server, acme, "Name a month", CHAT_MODEL, family="factual")
    ask(server, acme, "Name a season", CHAT_MODEL, stream=True)
    expected |= {"Name a month", "Name a season"}
    # A cheaper tier's answer that passed the caller's JSON Schema.
    ask(server, acme, "Is the sky blue? Reply in JSON.", SMALL, family="extraction", stop=None, max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}})
    expected.add("Is the sky blue? Reply in JSON.")
    # Through the Responses API, its family in metadata, marked good.
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=analyst, max_retries=0)
    river = client.responses.create(model="auto", instructions=SYSTEM, input="Name a river", max_output_tokens=16, temperature=0,
                                    metadata={"family": "factual"}).id
    expected.add("Name a river")
    # Good through a cache hit: the answer's entry is verified, and the kept answer behind it with it.
    ask(server, intern, "Name a colour")
    wait_for(server, "SELECT count(*) FROM cache_entries WHERE question LIKE '%Name a colour%'", 1)
    hit = ask(server, intern, "Name a colour")
    expected.add("Name a colour")
    for key, response_id, rating in ((intern, good, "good"), (analyst, bad, "bad"), (zeta, stranger, "good"), (intern, hit, "good"),
                                     (analyst, river, "good")):
        assert rate(server, key, response_id, rating).status_code == 200
    wait_for(server, "SELECT count(*) FROM kept_answers", 11)
    yield {"server": server, "expected": expected, "keys": {"acme": acme, "zeta": zeta}}
    stop_server(server)


def export(server: Server, out: Path, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    previous = os.environ.get("APPLIANCE_HOME")
    os.environ["APPLIANCE_HOME"] = str(server.home)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            parsed = build_parser().parse_args(["distill", "export", "--config", str(server.home.parent / "models.toml"), "--out", str(out), *args])
            code = parsed.func(parsed)
    finally:
        if previous is None:
            del os.environ["APPLIANCE_HOME"]
        else:
            os.environ["APPLIANCE_HOME"] = previous
    return code, stdout.getvalue(), stderr.getvalue()


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def user_turns(path: Path) -> list[str]:
    return [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in lines(path)]


def test_only_opted_in_answers_are_kept_each_with_who_produced_it(traffic: dict[str, Any]) -> None:
    rows = db(traffic["server"]).execute("SELECT tenant, route, model, family, validator, rating, messages FROM kept_answers").fetchall()
    assert {r[0] for r in rows} == {"acme"}  # zeta opted in to nothing
    by_question = {json.loads(r[6])[-1]["content"]: r[1:6] for r in rows}
    assert by_question["Name a fruit"] == ("auto", SMALL, None, None, "good")
    assert by_question["Name an animal"] == ("auto", CHAT_MODEL, None, None, "bad")
    assert by_question["Name a month"] == (None, CHAT_MODEL, "factual", None, None)
    assert by_question["Name a river"] == ("auto", CHAT_MODEL, "factual", None, "good")
    assert by_question["Is the sky blue? Reply in JSON."] == (None, SMALL, "extraction", "json_schema", None)
    assert json.loads(rows[0][6])[0] == {"role": "system", "content": SYSTEM}


def test_export_keeps_exactly_the_verified_opted_in_clean_examples(traffic: dict[str, Any], tmp_path: Path) -> None:
    server = traffic["server"]
    code, out, err = export(server, tmp_path / "data", "--route", "auto", "--since", "1d", "--held-out", "0.5", "--seed", "3")
    assert code == 0, err
    for line in ("found: 11 ", "verified: 9", "opted in: 9", "dropped for personal data: 1", "duplicates: 1"):
        assert line in out, out
    train, held = user_turns(tmp_path / "data" / "train.jsonl"), user_turns(tmp_path / "data" / "held-out.jsonl")
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(traffic["expected"])
    assert f"train: {len(train)} " in out and f"held out: {len(held)} " in out
    (record, *_) = lines(tmp_path / "data" / "train.jsonl") or lines(tmp_path / "data" / "held-out.jsonl")
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"] and record["messages"][2]["content"]
    manifest = json.loads((tmp_path / "data" / "export.json").read_text())
    assert manifest["tiers"] == [SMALL, CHAT_MODEL] and manifest["counts"]["train"] == len(train)
    # The same export again: the same examples on the same sides, byte for byte.
    assert export(server, tmp_path / "again", "--route", "auto", "--since", "1d", "--held-out", "0.5", "--seed", "3")[0] == 0
    for name in ("train.jsonl", "held-out.jsonl"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "data" / name).read_bytes()


def test_a_program_answer_is_kept_as_the_program_its_tier_was_asked_for(traffic: dict[str, Any], tmp_path: Path) -> None:
    """The caller got the program and its computed answer; a student is asked what the tier was asked
    (the program prompt in place of the caller's system turn) and learns the program as it was written."""
    server, key = traffic["server"], traffic["keys"]["acme"]
    copy = "Copy this program exactly:\n```python\nanswer = 3 + 4\n```"  # SmolLM2 copies it (tests/test_router.py)
    response_id = ask(server, key, copy, "programs", family="sums", stop=None, max_tokens=96)
    wait_for(server, "SELECT count(*) FROM kept_answers WHERE route = 'programs'", 1)
    messages, answer = db(server).execute("SELECT messages, answer FROM kept_answers WHERE route = 'programs'").fetchone()
    asked = [{"role": "system", "content": PROMPT}, {"role": "user", "content": copy}]
    assert json.loads(messages) == asked
    assert straight_line(program_of(answer)) == 7 and "Answer:" not in answer
    assert rate(server, key, response_id, "good").status_code == 200
    code, _, err = export(server, tmp_path / "programs", "--route", "programs", "--family", "sums", "--since", "1d", "--held-out", "0")
    assert code == 0, err
    (record,) = lines(tmp_path / "programs" / "train.jsonl")
    assert record["messages"] == [*asked, {"role": "assistant", "content": answer}]


def test_export_by_family(traffic: dict[str, Any], tmp_path: Path) -> None:
    code, out, err = export(traffic["server"], tmp_path / "factual", "--family", "factual", "--held-out", "0")
    assert code == 0, err
    assert sorted(user_turns(tmp_path / "factual" / "train.jsonl")) == ["Name a month", "Name a river", "What is the capital of France?"]
    assert "duplicates: 1" in out


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--route", "nope"], 1, "--route: "),
    (["--since", "a while"], 2, "--since: "),
    (["--since", "2999-01-01"], 2, "--since: "),
    (["--held-out", "1.5"], 1, "--held-out: "),
    (["--family", "poetry"], 1, "no kept answers of route 'auto' and family 'poetry'"),
    (["--since", "1s", "--family", "factual"], 1, "no kept answers"),
])
def test_bad_input_is_one_line_and_writes_nothing(traffic: dict[str, Any], tmp_path: Path, args: list[str], code: int, says: str) -> None:
    if args[:2] == ["--since", "1s"]:
        time.sleep(1.1)
    result = export(traffic["server"], tmp_path / "out", *args)
    assert result[0] == code and result[2].startswith(f"error: {says}") and result[2].count("\n") == 1, result
    assert not (tmp_path / "out").exists()


def test_out_is_replaced_whole_or_left_alone(traffic: dict[str, Any], tmp_path: Path) -> None:
    server = traffic["server"]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, _, err = export(server, blocker / "data")
    assert code == 1 and err.startswith("error: --out: ") and err.count("\n") == 1
    # A folder holding anything but an earlier export is never swapped away.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    code, _, err = export(server, mine)
    assert code == 1 and "holds other files (notes.txt)" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # An earlier export is replaced whole, by a different split.
    data = tmp_path / "data"
    assert export(server, data, "--held-out", "0")[0] == 0
    assert export(server, data, "--held-out", "0.5", "--seed", "1")[0] == 0
    assert json.loads((data / "export.json").read_text())["seed"] == 1
    assert sorted(p.name for p in data.iterdir()) == ["export.json", "held-out.jsonl", "train.jsonl"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
    if os.geteuid() == 0:
        return  # root writes into a read-only folder
    data.chmod(0o500)
    tmp_path.chmod(0o500)
    try:
        code, _, err = export(server, data, "--held-out", "0")
    finally:
        tmp_path.chmod(0o700)
        data.chmod(0o700)
    assert code == 1 and err.startswith("error: --out: ")
    assert json.loads((data / "export.json").read_text())["seed"] == 1
