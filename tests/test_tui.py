"""The TUI driven by Textual's pilot against a real server: every screen shows real data, and each
action changes the server's state (checked through the API)."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import math
import re
from collections.abc import Iterator

import httpx
import pytest
from textual.widgets import DataTable, Footer, Input, Static, TabbedContent, Tree
from textual.widgets._footer import FooterKey
from textual.widgets._toast import Toast

from tests.conftest import CHAT_MODEL, Server, config_text, free_port, start_server, stop_server
from tui import overview, views
from tui.app import ApplianceTUI
from tui.money import money, typed_usd
from tui.widgets import SecretScreen


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("tui"), config_text(embeddings=False, cache="enabled = true\nsweep_interval_s = 0"))
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "What is the capital of Peru?"}], "max_tokens": 6, "temperature": 0}
    for _ in range(2):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    yield server
    stop_server(server)


async def settle(pilot, app: ApplianceTUI, until, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.1)):
        await pilot.pause(0.1)
        if until():
            return
    raise AssertionError("the screen never showed it")


def keys(text: str) -> list[str]:
    return ["space" if c == " " else c for c in text]


def text_of(app: ApplianceTUI, selector: str) -> str:
    return str(app.query_one(selector, Static).render())


async def test_overview_budgets_and_traces_show_real_data(served: Server) -> None:
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app, lambda: CHAT_MODEL in text_of(app, "#overview-models"))
        assert "connected to" in text_of(app, "#status")
        assert "cache hit rate 50%" in text_of(app, "#overview-body")
        await pilot.press("2", "down", "e")  # on the tenants' row: the prompt starts "tenant "
        assert app.query_one("#prompt", Input).value == "tenant "
        await pilot.press(*keys("acme 5 day"), "enter")
        await settle(pilot, app, lambda: "acme" in str([n.label for n in app.query_one("#budget-tree", Tree).root.children[0].children]))
        budgets = httpx.get(f"{served.base_url}/admin/budgets").json()["budgets"]
        assert {"level": "tenant", "name": "acme", "limit_usd": 5.0} .items() <= next(b for b in budgets if b["name"] == "acme").items()
        await pilot.press("4")
        table = app.query_one("#trace-table", DataTable)
        await settle(pilot, app, lambda: table.row_count >= 2)
        await pilot.press("t", *keys("nobody-has-this"), "enter")
        await settle(pilot, app, lambda: table.row_count == 0)
        await pilot.press("t", *keys("local"), "enter")  # the open principal's tenant
        await settle(pilot, app, lambda: table.row_count >= 2)
        table.focus()
        await pilot.press("enter")
        await settle(pilot, app, lambda: f"chat {CHAT_MODEL}" in text_of(app, "#trace-timeline"))
        assert "engine.generate" in text_of(app, "#trace-timeline") or "cache.lookup" in text_of(app, "#trace-timeline")


async def test_keys_are_created_and_revoked(served: Server) -> None:
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5", "n")
        await pilot.press(*keys("acme web ann dev"), "enter")
        await settle(pilot, app, lambda: isinstance(app.screen, SecretScreen))
        listed = httpx.get(f"{served.base_url}/admin/keys").json()["keys"]
        made = [k for k in listed if k["user"] == "ann" and k["tenant"] == "acme"]
        assert len(made) == 1 and made[0]["revoked_at"] is None
        # The secret, shown once, stays up through several polls, inside the screen and above the footer.
        await pilot.pause(1.5)
        dialog = app.screen
        assert isinstance(dialog, SecretScreen) and dialog.key_id == made[0]["id"] and dialog.secret.startswith("apl-")
        shown = dialog.query_one("#secret-text", Static)
        assert str(shown.render()) == dialog.secret
        assert shown.region.bottom <= dialog.query_one(Footer).region.y and shown.region.right <= 80
        await pilot.press("c")
        assert app.clipboard == dialog.secret
        await pilot.press("escape")
        table = app.query_one("#key-table", DataTable)
        assert not isinstance(app.screen, SecretScreen) and app.focused is table
        await settle(pilot, app, lambda: table.row_count >= 1)
        await pilot.press("d", *keys(made[0]["id"]), "enter")  # revoking asks for the key's id (tests/test_tui_confirm.py)
        await settle(pilot, app, lambda: httpx.get(f"{served.base_url}/admin/keys").json()["keys"][0]["revoked_at"] is not None)


async def test_cache_entries_are_searched_and_marked(served: Server) -> None:
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        buckets = app.query_one("#cache-buckets", DataTable)
        await settle(pilot, app, lambda: buckets.row_count >= 1)
        # the cache's promise beside its own estimate, per language, from the running server
        await settle(pilot, app, lambda: re.search(r"false hits ≤2\.0%, est\. .*\ben \d", text_of(app, "#cache-summary")) is not None)
        assert "consistent" in [str(c.label) for c in buckets.columns.values()]
        await pilot.press("slash", *keys("Peru"), "enter")
        entries = app.query_one("#cache-entries", DataTable)
        await settle(pilot, app, lambda: entries.row_count == 1)
        # whose entry it is and how its answer starts, from the server's own entry
        stored = httpx.get(f"{served.base_url}/admin/cache/entries", params={"q": "Peru"}).json()["entries"][0]
        row = [str(c) for c in entries.get_row_at(0)]
        assert row[:4] == [str(stored["id"]), "unverified", str(stored["hits"]), "local"] and stored["answer"].startswith(row[5].rstrip("…"))
        entries.focus()
        await pilot.press("v")
        # the row says verified at once: no search again, no restart
        await settle(pilot, app, lambda: str(entries.get_row_at(0)[1]) == "verified", timeout=2)
        assert httpx.get(f"{served.base_url}/admin/cache/entries", params={"q": "Peru"}).json()["entries"][0]["state"] == "verified"


async def test_a_server_that_is_down_is_shown_and_retried() -> None:
    port = free_port()
    app = ApplianceTUI(f"http://127.0.0.1:{port}", None, interval_s=0.3)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app, lambda: "unreachable" in text_of(app, "#status"))
        assert not app.connected
        await asyncio.sleep(0)


def test_views_are_plain_functions() -> None:
    text = ("# TYPE appliance_http_responses_total counter\n"
            "appliance_http_responses_total{route=\"/v1/chat/completions\",status_class=\"2xx\",code=\"\"} 10.0\n"
            "appliance_http_responses_total{route=\"/metrics\",status_class=\"2xx\",code=\"\"} 50.0\n"
            "# TYPE appliance_slots_busy gauge\nappliance_slots_busy{model=\"m\"} 1.0\n"
            "# TYPE appliance_slots_total gauge\nappliance_slots_total{model=\"m\"} 8.0\n")
    then, now = overview.parse_metrics(text.replace("10.0", "4.0"), 0.0), overview.parse_metrics(text, 2.0)
    shown = overview.overview(now, then, None)
    assert shown.requests_per_s == 3.0 and shown.models == [("m", "1/8", 0)]
    bound = {"en": {"traps": 944, "estimate": 0.0117, "upper": 0.0192, "bound": 0.02, "open": True},
             "pt": {"traps": 370, "estimate": 0.0054, "upper": 0.0169, "bound": 0.02, "open": True},
             "ja": {"traps": 0, "estimate": 0.0, "upper": 1.0, "bound": 0.02, "open": False}}
    assert views.false_hit_line({"false_hit_bound": bound}) == "false hits ≤2.0%, est. en 1.2% pt 0.5%, others exact only"
    closed = {"ja": bound["ja"]}
    assert views.false_hit_line({"false_hit_bound": closed}) == "false hits ≤2.0%: exact repeats only (too few known near misses)"
    assert views.false_hit_line({}) == "false hits: no bound (thresholds decide)"
    judged = {**bound, "en": {**bound["en"], "judge": {"cut": 0.82, "traps_asked": 51, "traps_in_band": 51}}}
    assert views.false_hit_line({"false_hit_bound": judged}) == "false hits ≤2.0% +judge, est. en 1.2% pt 0.5%, others exact only"
    bucket = {"bucket": "b" * 32, "tenant": "t", "role": "r", "model": "m", "entries": 3, "hits": 2, "verified": 1, "consistent": 1,
              "rejected": 0, "stale": None}
    assert views.cache_rows({"buckets": [bucket]}) == [("b" * 12, "t", "r", "m", "3", "2", "1", "1", "0", "0")]
    tree = views.budget_tree({"budgets": [{"level": "tenant", "name": "acme", "limit_usd": 5, "spent_usd": 1, "held_usd": 0, "period": "day"}],
                              "reservations": []})
    assert tree.children[0].children[0].label == "acme" and "$1.00 of $5.00 per day" in tree.children[0].children[0].detail
    rows = views.trace_rows({"traces": [{"trace_id": "t", "name": "chat m", "duration_ms": 5, "error": True,
                                         "attributes": {"appliance.tenant": "acme", "appliance.model": "m"}}]}, "ok")
    assert rows == []
    rows = views.trace_rows({"traces": [{"trace_id": "t" * 32, "name": "chat m", "duration_ms": 5, "error": False,
                                         "attributes": {"appliance.tenant": "acme", "appliance.model": "m", "appliance.cache.result": "miss"}}]}, "ok", "acme")
    assert rows == [("t" * 32, ("t" * 8, "chat", "acme", "m", "miss", "5 ms", "ok"))]
    models = {"models": [{"alias": "m", "slots": [{"slot": 0, "state": "decode", "tokens": 300}, {"slot": 1, "state": "idle", "tokens": 100},
                                                  {"slot": 2, "state": "waiting", "tokens": 0}], "kv_used_tokens": 400, "kv_capacity_tokens": 1000}]}
    assert views.slot_lines(models) == ["m  slots D·W  KV 40% of 1000 tokens"]
    upstream = {"models": [{"alias": "big", "upstreams": [{"name": "gpu1:8000", "breaker": "closed", "healthy": True, "outstanding": 2},
                                                          {"name": "gpu2:8000", "breaker": "half_open", "healthy": False, "outstanding": 0}]}]}
    assert views.slot_lines(upstream) == ["big  upstream gpu1:8000 closed 2 in flight; gpu2:8000 half-open unhealthy 0 in flight"]
    assert views.progress_bar(0.5, 10) == "█████░░░░░" and views.progress_bar(None, 4) == "····"


def _resident(alias: str, **values: object) -> dict[str, object]:
    """A row of GET /admin/models/loaded: a model loaded on demand, idle, by default."""
    return {"alias": alias, "engine": "llamacpp", "kind": "chat", "retired": False, "loaded": True, "loading": False, "preload": False,
            "memory_bytes": 238216448, "slots_total": 2, "slots_busy": 0, "queue_depth": 0, "waiting_for_load": 0, "idle_s": 75.4,
            "keep_alive_s": 600.0, "unloads_in_s": 524.6, "loaded_for_s": 80.0, "loads": 1, **values}


def test_the_models_table_is_what_appliance_ps_shows() -> None:
    """GET /admin/models and GET /admin/models/loaded merged by alias: residency, memory, slots
    (requests waiting for a load count as queued), idle time and when each model unloads."""
    configured = {"models": [{"alias": a, "engine": e, "kind": k, "slots_busy": 0, "slots_total": 2, "queue_depth": 0}
                             for a, e, k in [("big", "llamacpp", "chat"), ("lazy", "llamacpp", "chat"), ("cold", "llamacpp", "embedding"),
                                             ("busy", "llamacpp", "chat"), ("new", "openai", "chat")]]}
    loaded = {"memory_budget_bytes": 4 << 30, "loaded_bytes": 3 * 238216448, "models": [
        _resident("big", preload=True, keep_alive_s=300.0, unloads_in_s=None, idle_s=4000.0),
        _resident("lazy"),
        _resident("cold", kind="embedding", loaded=False, loading=True, idle_s=None, unloads_in_s=None, waiting_for_load=3),
        _resident("busy", slots_busy=2, queue_depth=1, idle_s=None, unloads_in_s=None, keep_alive_s=None),
        _resident("lazy", retired=True, slots_busy=1, idle_s=None, unloads_in_s=None, memory_bytes=None),
    ]}
    rows = views.fleet_rows(configured, loaded)
    assert [(r.alias, r.retired) for r in rows] == [("big", False), ("lazy", False), ("cold", False), ("busy", False), ("new", False),
                                                    ("lazy", True)]
    assert [r.cells for r in rows] == [
        ("big", "llamacpp", "chat", "yes", "227", "0/2", "0", "1h06m", "never"),
        ("lazy", "llamacpp", "chat", "yes", "227", "0/2", "0", "1m15s", "8m45s"),
        ("cold", "llamacpp", "embed", "loading", "227", "0/2", "3", "–", "–"),
        ("busy", "llamacpp", "chat", "yes", "227", "2/2", "1", "–", "never"),  # keep_alive -1: never unloaded
        ("new", "openai", "chat", "–", "–", "0/2", "0", "–", "–"),  # added between the two answers
        ("lazy", "llamacpp", "chat", "retiring", "–", "1/2", "0", "–", "when idle"),
    ]
    assert views.unloads_in(_resident("m", idle_s=None, unloads_in_s=None)) == "when idle"  # serving: its keep_alive starts after
    assert views.unloads_in(_resident("m", loaded=False, idle_s=None, unloads_in_s=None)) == "–"
    assert views.memory_line(loaded) == "memory in use: 682 MiB of a 4096 MiB budget"
    assert views.memory_line({"memory_budget_bytes": None, "loaded_bytes": 0, "models": []}) == "memory in use: 0 MiB (no budget)"
    assert [views.duration(s) for s in (None, 0.4, 59.6, 61, 3599, 7260)] == ["–", "0s", "1m00s", "1m01s", "59m59s", "2h01m"]
    models = {"models": [{"alias": "lazy", "slots": []}, {"alias": "m", "slots": [{"state": "idle"}], "kv_used_tokens": 0,
                                                          "kv_capacity_tokens": 512, "prefix": {"prompt_tokens": 200, "reused_in_slot": 150},
                                                          "speculation_stats": {"drafted": 40, "accepted": 30}}]}
    assert views.slot_lines(models, {"models": [_resident("lazy", loaded=False), _resident("m")]}) == [
        "lazy  not loaded", "m     slots ·  KV 0% of 512 tokens  prefix hit 75%  drafts accepted 75%"]


@pytest.mark.parametrize(("typed", "parsed"), [
    ("/models/a.gguf", ("/models/a.gguf", None, None)),
    ("/models/a.gguf mine", ("/models/a.gguf", "mine", None)),
    ("/models/a.gguf like base", ("/models/a.gguf", None, "base")),
    ("/models/a.gguf mine like base", ("/models/a.gguf", "mine", "base")),
    ("'/my models/a.gguf' mine", ("/my models/a.gguf", "mine", None)),  # quotes keep a path with spaces whole
    ("", None), ("/models/a.gguf mine base", None), ("/models/a.gguf like", ("/models/a.gguf", "like", None)), ("'/unclosed", None),
])
def test_an_added_models_words(typed: str, parsed: tuple[str, str | None, str | None] | None) -> None:
    assert views.add_model_args(typed) == parsed


def test_the_tui_in_tmux_as_a_person_would(served: Server) -> None:
    """The real command in a real terminal: keys sent with send-keys, the screen read back."""
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    session = f"appliance-tui-{os.getpid()}"
    command = f"cd {ROOT} && {sys.executable} -m appliance.cli.main tui --url {served.base_url}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", command], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_for(text: str) -> str:
        deadline = time.monotonic() + 20
        while text not in (shown := screen()):
            assert time.monotonic() < deadline, f"{text!r} never appeared:\n{shown}"
            time.sleep(0.2)
        return shown

    try:
        shown = wait_for("connected to")
        assert CHAT_MODEL in wait_for(CHAT_MODEL) and "requests/s" in shown
        time.sleep(4.5)  # two more polls, each logged by httpx at INFO under the CLI's logging
        assert "HTTP Request" not in screen() and "INFO" not in screen()
        subprocess.run(["tmux", "send-keys", "-t", session, "5"], check=True)
        wait_for("role")  # the keys table's header
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 10
        while subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "q did not quit"
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


async def test_models_screen_loads_and_unloads_adapters_and_quantizes(served: Server) -> None:
    from appliance.fleet.files import package_file
    from appliance.config.settings import load_settings
    from tests.conftest import MODEL_FILE
    from tests.test_lora import write_lora

    # the admin API takes paths inside the server's data directory
    adapter = write_lora(served.home / "tui-adapter.gguf", seed=7)
    source = served.home / "copy.Q4_1.gguf"
    source.write_bytes(package_file(MODEL_FILE).read_bytes())
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        models = app.query_one("#model-table", DataTable)
        await settle(pilot, app, lambda: models.row_count == 1)
        assert str(models.get_row_at(0)[0]) == CHAT_MODEL
        assert f"{CHAT_MODEL}" in text_of(app, "#slots") and "slots ········" in text_of(app, "#slots") and "KV " in text_of(app, "#slots")
        await pilot.press("a", *keys(f"{CHAT_MODEL} tuiad {adapter} 0.5"), "enter")
        adapters = app.query_one("#adapter-table", DataTable)
        await settle(pilot, app, lambda: adapters.row_count == 1)
        listed = httpx.get(f"{served.base_url}/admin/models/{CHAT_MODEL}/adapters").json()["adapters"]
        assert [(a["name"], a["scale"]) for a in listed] == [("tuiad", 0.5)]
        adapters.focus()
        await pilot.press("u")
        await settle(pilot, app, lambda: httpx.get(f"{served.base_url}/admin/models/{CHAT_MODEL}/adapters").json()["adapters"] == [])
        # quantize through the server: a job with a progress bar, then registered in models.toml
        await pilot.press("z", *keys(f"{source} q8_0 requantize"), "enter")
        await settle(pilot, app, lambda: "done" in text_of(app, "#jobs") and "100%" in text_of(app, "#jobs"), timeout=60)
        assert "registered it as 'copy.q8_0'" in text_of(app, "#jobs")
    config = load_settings(served.home.parent / "models.toml")
    added = config.model("copy.q8_0")
    assert added is not None and added.path == served.home / "copy.Q8_0.gguf" and added.path.is_file()
    jobs = httpx.get(f"{served.base_url}/admin/jobs").json()["jobs"]
    assert jobs[0]["kind"] == "quantize" and jobs[0]["state"] == "done"


async def test_models_screen_starts_a_training_job_for_the_quiet_hours_and_stops_it(served: Server) -> None:
    """t starts `POST /admin/distill/train` (held until a time of day, so nothing trains here), the
    jobs pane shows it waiting, and s stops it."""
    from datetime import datetime, timedelta

    from tests.test_distill_train import examples_text

    (served.home / "tui-train.jsonl").write_text(examples_text())
    later = (datetime.now() + timedelta(minutes=3)).strftime("%H:%M")
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("6")
        await pilot.press("T", *keys(f"{CHAT_MODEL} tui-train.jsonl tuitrain at {later}"), "enter")
        await settle(pilot, app, lambda: f"waiting until {later}" in text_of(app, "#jobs"), timeout=30)
        assert "train" in text_of(app, "#jobs") and "running" in text_of(app, "#jobs")
        await pilot.press("s")
        await settle(pilot, app, lambda: "cancelled" in text_of(app, "#jobs"), timeout=30)
    job = next(j for j in httpx.get(f"{served.base_url}/admin/jobs").json()["jobs"] if j["kind"] == "train")
    assert job["state"] == "cancelled" and "while waiting" in job["message"], job


def test_train_prompt_words() -> None:
    assert views.train_args(["s", "d.jsonl"]) == ("s", "d.jsonl", None, None)
    assert views.train_args(["s", "d", "n", "at", "02:00"]) == ("s", "d", "n", "02:00")
    assert views.train_args(["s"]) is None and views.train_args(["s", "d", "n", "x"]) is None


async def test_models_screen_pulls_a_model_from_the_hub(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`p` asks the server to download a GGUF through huggingface-hub (a local hub here) and
    register it; the job's progress bar ends at 100% and models.toml names the file."""
    from appliance.fleet.files import package_file
    from appliance.config.settings import load_settings
    from tests.conftest import MODEL_FILE
    from tests.fake_hub import FakeHub

    with FakeHub({"acme/smol-GGUF/smol.Q4_1.gguf": package_file(MODEL_FILE)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        server = start_server(tmp_path / "pull", config_text(slots=1, embeddings=False))
        try:
            app = ApplianceTUI(server.base_url, None, interval_s=0.5)
            async with app.run_test(size=(80, 24)) as pilot:
                await pilot.press("6", "p", *keys("acme/smol-GGUF smol.Q4_1.gguf"), "enter")
                await settle(pilot, app, lambda: "done" in text_of(app, "#jobs"), timeout=60)
                assert "100%" in text_of(app, "#jobs") and "registered it as 'smol.q4_1'" in text_of(app, "#jobs")
                assert "now served" in text_of(app, "#jobs")
                models = app.query_one("#model-table", DataTable)
                await settle(pilot, app, lambda: "smol.q4_1" in {str(models.get_row_at(i)[0]) for i in range(models.row_count)})
            # the pulled model answers, without a restart
            reply = server.client(timeout=120).chat.completions.create(
                model="smol.q4_1", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0.0)
            assert reply.choices[0].finish_reason in ("stop", "length")
        finally:
            stop_server(server)
    added = load_settings(tmp_path / "pull" / "models.toml").model("smol.q4_1")
    assert added is not None and added.path is not None and added.path.is_file()
    assert added.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _on_demand_config() -> str:
    """One model loaded on its first request and unloaded 10 minutes after its last, and the
    bundled model's folder, from which the operator may add model files."""
    from appliance.fleet.files import package_file
    from tests.conftest import MODEL_FILE

    return f"""
[server]
model_dirs = ["{package_file(MODEL_FILE).parent}"]

[auth]
mode = "open"

[auth.open_principal]
admin = true

[cache]
enabled = false

[[models]]
alias = "lazy"
package_file = "{MODEL_FILE}"
context_length = 512
slots = 2
threads = 2
preload = false
keep_alive = "10m"
"""


def toasts(app: ApplianceTUI) -> str:
    return "\n".join(str(t.render()) for t in app.screen.query(Toast))


async def test_models_screen_loads_unloads_adds_and_removes_models(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`l` and `o` load and unload the selected model and its row says so; `n` adds a model file
    on the server, which answers at once; `x` removes one once its alias is typed, and the API
    stops serving it. No restart anywhere: each change is checked through the API."""
    from appliance.fleet.files import package_file
    from tests.conftest import MODEL_FILE

    from appliance.fleet.memory import model_estimate
    from appliance.config.settings import parse_settings

    settings = parse_settings(_on_demand_config(), "m.toml", tmp_path)
    mib = f"{model_estimate(settings.model('lazy'), package_file(MODEL_FILE)).total / 2**20:.0f}"  # what the row shows
    server = start_server(tmp_path / "on-demand", _on_demand_config())

    def resident(alias: str) -> dict:  # type: ignore[type-arg]
        rows = httpx.get(f"{server.base_url}/admin/models/loaded", timeout=10).json()["models"]
        return next(m for m in rows if m["alias"] == alias and not m["retired"])

    def served() -> set[str]:
        return {m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]}

    try:
        app = ApplianceTUI(server.base_url, None, interval_s=0.3)
        async with app.run_test(size=(80, 24), notifications=True) as pilot:  # the toasts say what each key did
            table = app.query_one("#model-table", DataTable)

            def row(alias: str) -> tuple[str, ...]:
                return next((r.cells for r in app.fleet if r.alias == alias and not r.retired), ())

            await pilot.press("6")
            await settle(pilot, app, lambda: row("lazy")[3:5] == ("no", mib))
            assert app.focused is table and "lazy  not loaded" in text_of(app, "#slots")
            assert text_of(app, "#memory") == "memory in use: 0 MiB (no budget)"
            await pilot.press("l")
            await settle(pilot, app, lambda: row("lazy")[3] == "yes")
            assert resident("lazy")["loaded"] and row("lazy")[-1].startswith(("9m", "10m"))  # keep_alive 10m, counting down
            await settle(pilot, app, lambda: text_of(app, "#memory") == f"memory in use: {mib} MiB (no budget)")
            await pilot.press("o")
            await settle(pilot, app, lambda: row("lazy")[3] == "no" and "lazy unloaded" in toasts(app))
            assert not resident("lazy")["loaded"]

            # a model file on the server, served at once (preloaded: no `like`, and no memory budget)
            await pilot.press("n", *keys(f"{package_file(MODEL_FILE)} added"), "enter")
            await settle(pilot, app, lambda: row("added") != ())
            assert "added" in served()
            reply = await server.async_client(timeout=120).chat.completions.create(
                model="added", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0.0)
            assert reply.choices[0].finish_reason in ("stop", "length") and reply.model == "added"
            await settle(pilot, app, lambda: row("added")[3] == "yes")

            await pilot.press(*["down"] * [r.alias for r in app.fleet].index("added"))
            await pilot.press("o")  # added models are preloaded: the server keeps them, and says why
            await settle(pilot, app, lambda: "preload" in toasts(app))
            assert resident("added")["loaded"]
            await pilot.press("x", *keys("lazy"), "enter")  # the wrong alias typed: nothing is removed
            await settle(pilot, app, lambda: "added was not removed" in toasts(app))
            assert "added" in served()
            await pilot.press("x", *keys("added"), "enter")
            await settle(pilot, app, lambda: "added" not in served())
            await settle(pilot, app, lambda: row("added") == ())
            assert served() == {"lazy"}
    finally:
        stop_server(server)


async def test_library_logs_never_reach_the_terminal(served: Server) -> None:
    """The CLI's basicConfig puts a stream handler on the root logger and httpx logs every poll at
    INFO: while the TUI runs nothing may write behind Textual's back, and the handlers come back after."""
    # Garbage of earlier tests first: an SDK's client collected here schedules its close, which fails on its closed
    # loop and is logged by asyncio when the task goes; only this test's logs count.
    gc.collect()
    await asyncio.sleep(0.05)
    gc.collect()
    behind = io.StringIO()
    handler = logging.StreamHandler(behind)
    root = logging.getLogger()
    level, earlier_httpx = root.level, logging.getLogger("httpx").level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # As a CLI without -v leaves it, unless an earlier in-process CLI call in this session quietened it.
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    httpx_level = logging.NOTSET
    try:
        app = ApplianceTUI(served.base_url, None, interval_s=0.2)
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot, app, lambda: len(app.samples) >= 3)
            logging.getLogger("appliance.test").warning("a warning while the TUI runs")
        assert behind.getvalue() == ""
        assert handler in root.handlers and logging.getLogger("httpx").level == httpx_level
        httpx.get(f"{served.base_url}/health")
        assert "HTTP Request: GET" in behind.getvalue()  # the CLI's logging as it was, once the TUI is gone
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logging.getLogger("httpx").setLevel(earlier_httpx)


async def test_each_screen_gives_its_table_the_keys(served: Server) -> None:
    """Enter opens a trace as soon as the traces screen shows, without Tab first."""
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        for digit, focused in [("2", "#budget-tree"), ("3", "#cache-buckets"), ("5", "#key-table"), ("6", "#model-table"), ("4", "#trace-table")]:
            await pilot.press(digit)
            await pilot.pause()
            assert app.focused is app.query_one(focused), digit
        table = app.query_one("#trace-table", DataTable)
        await settle(pilot, app, lambda: table.row_count >= 2)
        await pilot.press("enter")
        await settle(pilot, app, lambda: f"chat {CHAT_MODEL}" in text_of(app, "#trace-timeline"))
        await pilot.click("#--content-tab-keys")  # a tab chosen with the mouse, too
        await pilot.pause()
        assert app.tab == "keys" and app.focused is app.query_one("#key-table")


async def test_screen_keys_work_whatever_has_focus(served: Server) -> None:
    """Tab moves the focus through every widget of the cache screen; 1-6 still switch screens from
    each (focus left behind in a hidden pane used to pull its tab back). In the prompt, digits type."""
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        tabs = app.query_one(TabbedContent)
        for presses in range(4):
            await pilot.press("3", *["tab"] * presses, "4")
            await pilot.pause(0.2)
            assert app.tab == tabs.active == "traces", f"{presses} tabs: {app.focused}"
        await pilot.press("3", "slash", "1", "2")
        prompt = app.query_one("#prompt", Input)
        assert prompt.value == "12" and app.tab == tabs.active == "cache"
        await pilot.press("escape", "6")
        await pilot.pause(0.2)
        assert app.tab == tabs.active == "models" and app.focused is app.query_one("#model-table")


async def test_the_footer_lists_the_screens_own_keys(served: Server) -> None:
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    expected = {
        "1": [], "2": ["Edit budget"], "3": ["Search", "Invalidate", "Verify", "Reject"], "4": ["Status filter", "Text filter", "Clear filters"],
        "5": ["New key", "Revoke"], "6": ["Load", "Unload", "Add model", "Remove model"],
    }
    async with app.run_test(size=(80, 24)) as pilot:
        for digit, own in expected.items():
            await pilot.press(digit)
            await pilot.pause(0.2)
            listed = [k.description for k in app.screen.query(FooterKey)]
            assert listed == [*own, "Refresh", "Quit"], digit
            footer = app.query_one(Footer)
            assert all(k.region.right <= footer.region.right for k in app.screen.query(FooterKey)), digit
        await pilot.press("1", "n", "slash", "a")  # another screen's keys do nothing here
        assert app.asking is None


async def test_the_trace_timeline_ends_above_the_footer(served: Server) -> None:
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        table = app.query_one("#trace-table", DataTable)
        await settle(pilot, app, lambda: table.row_count >= 2)
        table.focus()  # as the pilot of a screen without focus on entry would (that has its own test)
        await pilot.press("down", "enter")  # the older request: the model's answer, the most spans
        timeline = app.query_one("#trace-timeline", Static)
        await settle(pilot, app, lambda: "engine.generate" in text_of(app, "#trace-timeline"))
        await pilot.pause()
        lines = text_of(app, "#trace-timeline").splitlines()
        assert app.screen.max_scroll_y == 0  # the screen itself never scrolls: nothing lies below the footer
        assert timeline.region.bottom <= app.query_one(Footer).region.y
        assert timeline.region.height >= min(len(lines), 12) and timeline.max_scroll_y == max(0, len(lines) - 12)


@pytest.mark.parametrize(("amount", "shown", "typed"), [
    (0, "$0", "0"),
    (1e-9, "$0.000000001", "0.000000001"),  # a nano-dollar, the ledger's unit
    (9.15e-6, "$0.00000915", "0.00000915"),  # never µ$9.15, never 9.15e-06
    (0.000123456, "$0.0001235", "0.000123456"),
    (0.5, "$0.5", "0.5"),
    (0.99996, "$1.00", "0.99996"),
    (5, "$5.00", "5"),
    (1234.567, "$1,234.57", "1234.567"),
])
def test_money_is_written_as_policy_budgets_writes_it(amount: float, shown: str, typed: str) -> None:
    assert money(amount) == shown and typed_usd(amount) == typed


# (upper bound, cumulative count): Prometheus' own histogram_quantile cases (promql/promqltest/testdata/histograms.test).
POSITIVE = ((0.1, 50.0), (0.2, 70.0), (1.0, 110.0), (math.inf, 120.0))
STARTS_AT_ZERO = ((0.0, 0.0), (0.1, 50.0), (0.2, 70.0), (1.0, 110.0), (math.inf, 110.0))
ONE_SLOW = ((1.0, 0.0), (2.5, 0.0), (5.0, 1.0), (10.0, 1.0), (math.inf, 1.0))  # one request, its first token after 2.5-5 s


@pytest.mark.parametrize(("buckets", "q", "bucket", "shown"), [
    (ONE_SLOW, 0.5, (2.5, 5.0), "2.5–5 s"), (ONE_SLOW, 0.95, (2.5, 5.0), "2.5–5 s"),  # not 3,750 ms and 4,875 ms
    (POSITIVE, 0.2, (0.0, 0.1), "≤100 ms"), (POSITIVE, 0.5, (0.1, 0.2), "100–200 ms"), (POSITIVE, 0.8, (0.2, 1.0), "200 ms–1 s"),
    (POSITIVE, 1.0, (1.0, math.inf), ">1 s"), (STARTS_AT_ZERO, 0.25, (0.0, 0.1), "≤100 ms"),
    (STARTS_AT_ZERO, 0.75, (0.2, 1.0), "200 ms–1 s"),
])
def test_ttft_is_the_bucket_its_quantile_falls_in(buckets: tuple[tuple[float, float], ...], q: float, bucket: tuple[float, float], shown: str) -> None:
    assert overview.quantile_bucket(buckets, q) == bucket
    assert overview.bucket_text(overview.quantile_bucket(buckets, q)) == shown


def test_ttft_has_no_estimate_without_observations() -> None:
    assert overview.quantile_bucket((), 0.5) is None
    assert overview.quantile_bucket(((0.1, 0.0), (math.inf, 0.0)), 0.5) is None
    assert overview.quantile_bucket(((0.1, 3.0), (math.inf, 3.0)), math.nan) is None
    assert overview.bucket_text(None) == "–"


def test_errors_count_every_refusal_and_ttft_reads_the_histogram() -> None:
    """Errors are every 4xx and 5xx the API answered, refusals before any model included; the TUI's
    own polls are not requests. The server leaves cache hits out of TTFT, so the buckets are read as they are."""
    text = ('# TYPE appliance_http_responses_total counter\n'
            'appliance_http_responses_total{route="/v1/chat/completions",status_class="2xx",code=""} 6.0\n'
            'appliance_http_responses_total{route="/v1/chat/completions",status_class="4xx",code="invalid_api_key"} 3.0\n'
            'appliance_http_responses_total{route="/v1/chat/completions",status_class="5xx",code="overloaded"} 1.0\n'
            'appliance_http_responses_total{route="/admin/budgets",status_class="2xx",code=""} 40.0\n'
            '# TYPE appliance_time_to_first_token_seconds histogram\n'
            + "".join(f'appliance_time_to_first_token_seconds_bucket{{le="{le}",model="m"}} {n}\n'
                      for le, n in [("0.01", 0.0), ("0.1", 0.0), ("0.25", 1.0), ("0.5", 2.0), ("+Inf", 2.0)]))
    sample = overview.parse_metrics(text, 0.0)
    assert (sample.requests, sample.errors) == (10.0, 4.0)
    assert sample.ttft_buckets == ((0.01, 0.0), (0.1, 0.0), (0.25, 1.0), (0.5, 2.0), (math.inf, 2.0))
    shown = overview.overview(sample, None, None)
    assert (shown.ttft_p50, shown.ttft_p95) == ((0.1, 0.25), (0.25, 0.5))
    assert "TTFT p50 100–250 ms   p95 250–500 ms" in overview.overview_lines(shown)


def test_a_table_fits_its_width_by_cutting_the_named_columns() -> None:
    headers = ("model", "kind", "unloads in")
    rows = [("a-rather-long-model-alias", "chat", "never"), ("m", "embed", "9m05s")]
    assert views.fit(headers, rows, 80, (0,)) == rows  # room enough: nothing cut
    cut = views.fit(headers, rows, 30, (0,))  # 25 + 5 + 10 + 2 per column = 46: the alias gives up 16
    assert cut == [("a-rather…", "chat", "never"), ("m", "embed", "9m05s")]
    assert views.fit(headers, rows, 10, (0,))[0][0] == "a-ra…"  # never below its header ("model"); past that the table stays wider


@pytest.mark.parametrize(("typed", "parsed"), [
    ("tenant acme 5 day", views.BudgetEdit("tenant", "acme", 5.0, "day")),
    ("global - 100 month", views.BudgetEdit("global", "*", 100.0, "month")),
    ("global 100 month", views.BudgetEdit("global", "*", 100.0, "month")),
    ("user ann $0.25 total", views.BudgetEdit("user", "ann", 0.25, "total")),
    ("tenant acme five day", "'five' is not an amount of dollars: write e.g. 5 or 0.25"),
    ("tenant acme -1 day", "'-1' is not an amount of dollars: write e.g. 5 or 0.25"),
    ("tenant acme nan day", "'nan' is not an amount of dollars: write e.g. 5 or 0.25"),
    ("tenant acme 5 week", "'week' is not a period: write day, month or total"),
    ("team acme 5 day", "'team' is not a level: write user, tenant, app or global"),
    ("tenant acme ", "write LEVEL NAME USD PERIOD, e.g. tenant acme 5 day (global - 100 month)"),
])
def test_a_budget_edit_is_read_or_says_what_is_wrong(typed: str, parsed: views.BudgetEdit | str) -> None:
    assert views.budget_args(typed) == parsed


def test_the_budget_tree_lists_spenders_without_a_limit_and_what_e_fills_in() -> None:
    tree = views.budget_tree({
        "budgets": [{"level": "global", "name": "*", "limit_usd": 100.0, "spent_usd": 0.5, "held_usd": 0.0, "period": "month"},
                    {"level": "tenant", "name": "acme", "limit_usd": 2.5, "spent_usd": 9.15e-06, "held_usd": 1e-06, "period": "day"}],
        "reservations": [],
        "top_spenders_today": {"tenant": [{"name": "globex", "spent_usd": 0.25}, {"name": "acme", "spent_usd": 9.15e-06}]},
    })
    tenants = tree.children[0]
    assert (tree.detail, tree.edit) == ("$0.5 of $100.00 per month", "global - 100 month")
    assert (tenants.detail, tenants.edit) == ("1 with a limit, 1 more spending today", "tenant ")
    assert [(n.label, n.detail, n.edit) for n in tenants.children] == [
        ("acme", "$0.00000915 of $2.50 per day (+$0.000001 held)", "tenant acme 2.5 day"),
        ("globex", "$0.25 today, no limit", "tenant globex "),
    ]


def test_each_chart_keeps_its_series_and_an_idle_scrape_repeats_the_last_value() -> None:
    def shown(**values: object) -> overview.Overview:
        base = {"requests_per_s": 0.0, "tokens_per_s": 0.0, "errors_per_s": 0.0, "ttft_p50": None, "ttft_p95": None, "ttft_mean_s": None,
                "models": [], "queue": 0, "hit_rate": None, "recent_hit_rate": None, "verified_cost_hit_rate": None,
                "spend_per_min_usd": 0.0, "spend_today_usd": None, "global_limit_usd": None, "global_period": None}
        return overview.Overview(**{**base, **values})  # type: ignore[arg-type]

    series = overview.Series(keep=3)
    assert [now for _, _, now in series.charts()] == ["–"] * 5
    series = series.add(shown(tokens_per_s=4.0, ttft_mean_s=0.2, queue=2, hit_rate=0.5, spend_per_min_usd=0.001))
    assert [values for _, values, _ in series.charts()] == [()] * 5  # one scrape draws nothing yet
    series = series.add(shown(tokens_per_s=8.0, queue=1, recent_hit_rate=1.0)).add(shown()).add(shown(ttft_mean_s=0.4))
    assert (series.tokens, series.ttft, series.queue, series.hits) == ((8.0, 0.0, 0.0), (0.2, 0.2, 0.4), (1, 0, 0), (1.0, 1.0, 1.0))
    assert [now for _, _, now in series.charts()] == ["0.0", "400 ms", "0", "$0", "100%"]
