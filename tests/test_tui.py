"""The TUI driven by Textual's pilot against a real server: every screen shows real data, and each
action changes the server's state (checked through the API)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from textual.widgets import DataTable, Static, Tree

from tests.conftest import CHAT_MODEL, Server, config_text, free_port, start_server, stop_server
from tui import views
from tui.app import ApplianceTUI


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
        await settle(pilot, app, lambda: CHAT_MODEL in text_of(app, "#overview-body"))
        assert "connected to" in text_of(app, "#status")
        assert "cache hit rate 50%" in text_of(app, "#overview-body")
        await pilot.press("e")
        await pilot.press(*keys("tenant acme 5 day"), "enter")
        await pilot.press("2")
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
        await settle(pilot, app, lambda: "chat.completions" in text_of(app, "#trace-timeline"))
        assert "engine.generate" in text_of(app, "#trace-timeline") or "cache.lookup" in text_of(app, "#trace-timeline")


async def test_keys_are_created_and_revoked(served: Server) -> None:
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5", "n")
        await pilot.press(*keys("acme web ann dev"), "enter")
        await settle(pilot, app, lambda: "shown once: apl-" in text_of(app, "#key-secret"))
        listed = httpx.get(f"{served.base_url}/admin/keys").json()["keys"]
        made = [k for k in listed if k["user"] == "ann" and k["tenant"] == "acme"]
        assert len(made) == 1 and made[0]["revoked_at"] is None
        table = app.query_one("#key-table", DataTable)
        await settle(pilot, app, lambda: table.row_count >= 1)
        table.focus()
        await pilot.press("d")
        await settle(pilot, app, lambda: httpx.get(f"{served.base_url}/admin/keys").json()["keys"][0]["revoked_at"] is not None)


async def test_cache_entries_are_searched_and_marked(served: Server) -> None:
    app = ApplianceTUI(served.base_url, None, interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        buckets = app.query_one("#cache-buckets", DataTable)
        await settle(pilot, app, lambda: buckets.row_count >= 1)
        await pilot.press("slash", *keys("Peru"), "enter")
        entries = app.query_one("#cache-entries", DataTable)
        await settle(pilot, app, lambda: entries.row_count == 1)
        entries.focus()
        await pilot.press("v")
        await settle(pilot, app, lambda: httpx.get(f"{served.base_url}/admin/cache/entries", params={"q": "Peru"}).json()["entries"][0]["state"] == "verified")


async def test_a_server_that_is_down_is_shown_and_retried() -> None:
    port = free_port()
    app = ApplianceTUI(f"http://127.0.0.1:{port}", None, interval_s=0.3)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app, lambda: "unreachable" in text_of(app, "#status"))
        assert not app.connected
        await asyncio.sleep(0)


def test_views_are_plain_functions() -> None:
    text = ("# TYPE appliance_requests_total counter\nappliance_requests_total{model=\"m\",endpoint=\"chat\",status=\"ok\"} 10.0\n"
            "# TYPE appliance_slots_busy gauge\nappliance_slots_busy{model=\"m\"} 1.0\n"
            "# TYPE appliance_slots_total gauge\nappliance_slots_total{model=\"m\"} 8.0\n")
    then, now = views.parse_metrics(text.replace("10.0", "4.0"), 0.0), views.parse_metrics(text, 2.0)
    shown = views.overview(now, then, None)
    assert shown.requests_per_s == 3.0 and shown.models == [("m", "1/8", 0)]
    assert views.sparkline([0, 1, 2, 4]) == "▁▂▄█"
    tree = views.budget_tree({"budgets": [{"level": "tenant", "name": "acme", "limit_usd": 5, "spent_usd": 1, "held_usd": 0, "period": "day"}],
                              "reservations": []})
    assert tree.children[0].children[0].label == "acme" and "$1.0000 of $5.00 per day" in tree.children[0].children[0].detail
    rows = views.trace_rows({"traces": [{"trace_id": "t", "name": "chat.completions", "duration_ms": 5, "error": True,
                                         "attributes": {"tenant": "acme", "model": "m"}}]}, "ok")
    assert rows == []
    models = {"models": [{"alias": "m", "slots": [{"slot": 0, "state": "decode", "tokens": 300}, {"slot": 1, "state": "idle", "tokens": 100},
                                                  {"slot": 2, "state": "waiting", "tokens": 0}], "kv_used_tokens": 400, "kv_capacity_tokens": 1000}]}
    assert views.slot_lines(models) == ["m                        slots D·W              KV 40% of 1000 tokens"]
    upstream = {"models": [{"alias": "big", "upstreams": [{"name": "gpu1:8000", "breaker": "closed", "healthy": True, "outstanding": 2},
                                                          {"name": "gpu2:8000", "breaker": "half_open", "healthy": False, "outstanding": 0}]}]}
    assert views.slot_lines(upstream) == ["big                      upstream gpu1:8000 closed 2 in flight; gpu2:8000 half-open unhealthy 0 in flight"]
    assert views.progress_bar(0.5, 10) == "█████░░░░░" and views.progress_bar(None, 4) == "····"


def test_the_tui_in_tmux_as_a_person_would(served: Server) -> None:
    """The real command in a real terminal: keys sent with send-keys, the screen read back."""
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    session = f"appliance-tui-{os.getpid()}"
    command = f"cd {ROOT} && {sys.executable} -m appliance.cli tui --url {served.base_url}"
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
    from appliance.model_files import package_file
    from appliance.settings import load_settings
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


async def test_models_screen_pulls_a_model_from_the_hub(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`p` asks the server to download a GGUF through huggingface-hub (a local hub here) and
    register it; the job's progress bar ends at 100% and models.toml names the file."""
    from appliance.model_files import package_file
    from appliance.settings import load_settings
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
        finally:
            stop_server(server)
    added = load_settings(tmp_path / "pull" / "models.toml").model("smol.q4_1")
    assert added is not None and added.path is not None and added.path.is_file()
    assert added.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
