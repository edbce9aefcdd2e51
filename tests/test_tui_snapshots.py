"""Snapshot tests of the TUI at 80×24 against a real server with live data, compared with SVG
snapshots in tests/__snapshots__ (pytest-textual-snapshot; `--snapshot-update` after a deliberate
change, and look at every SVG before accepting it).

The server is the real one with the bundled model; what differs from one run to the next is pinned
by PinnedClient before the TUI sees it, and nothing else: the port in the status line, trace and
key ids, a key's secret, span timings, the bucket each first token fell in, and how long each model
has been loaded and idle."""

from __future__ import annotations

import base64
import hashlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from rich.cells import cell_len
from textual.widgets import DataTable, Input, Static

from tests.conftest import CHAT_MODEL, Server, config_text, start_server, stop_server
from tui.app import ApplianceTUI, SecretScreen
from tui.client import AdminClient

PINNED_URL = "http://127.0.0.1:8080"
_BUCKET = re.compile(r'^appliance_time_to_first_token_seconds_bucket\{(?P<labels>[^}]*)\} (?P<count>\S+)$', re.M)
_SUM = re.compile(r'^appliance_time_to_first_token_seconds_sum\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)
_MODEL = re.compile(r'model="([^"]*)"')
_LE = re.compile(r'le="([^"]*)"')


class PinnedClient(AdminClient):
    """The admin API of the real server, with the values that change from run to run replaced by
    fixed ones: ids become stable pseudo-ids in the order first seen, the n-th span of a trace
    starts n ms in and lasts 1 ms per span under it, and every model answer's first token falls
    in the (0.1 s, 0.25 s] bucket, 175 ms after its request came (the server leaves cache hits out of TTFT)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url, None)
        self.base_url = PINNED_URL  # what the status line names; the real port is a free one
        self.pinned: dict[str, str] = {}

    def _pin(self, real: str, prefix: str, length: int) -> str:
        if real not in self.pinned:
            self.pinned[real] = prefix + hashlib.sha256(f"{prefix}{len(self.pinned)}".encode()).hexdigest()[:length]
        return self.pinned[real]

    def _real(self, pinned: str) -> str:
        return next((real for real, shown in self.pinned.items() if shown == pinned), pinned)

    async def metrics(self) -> str:
        text = await super().metrics()
        totals = {_MODEL.search(m["labels"])[1]: float(m["count"]) for m in _BUCKET.finditer(text) if 'le="+Inf"' in m["labels"]}

        def pinned(m: re.Match[str]) -> str:
            model, le = _MODEL.search(m["labels"])[1], float(_LE.search(m["labels"])[1])  # type: ignore[index]
            count = totals[model] if le >= 0.25 else 0.0
            return f"appliance_time_to_first_token_seconds_bucket{{{m['labels']}}} {count}"

        def pinned_sum(m: re.Match[str]) -> str:
            return f"appliance_time_to_first_token_seconds_sum{{{m['labels']}}} {totals[_MODEL.search(m['labels'])[1]] * 0.175}"  # type: ignore[index]

        return _SUM.sub(pinned_sum, _BUCKET.sub(pinned, text))

    async def traces(self, limit: int = 100) -> dict[str, Any]:
        listed = await super().traces(limit)
        for t in listed["traces"]:
            spans = _walk((await super().trace(t["trace_id"]))["spans"])
            t["trace_id"], t["duration_ms"] = self._pin(t["trace_id"], "", 32), float(len(spans))
        return listed

    async def trace(self, trace_id: str) -> dict[str, Any]:
        tree = await super().trace(self._real(trace_id))
        spans = _walk(tree["spans"])
        start = min((s["start_ns"] for s in spans), default=0)
        for n, span in enumerate(spans):
            span["start_ns"], span["duration_ms"] = start + n * 1_000_000, float(len(_walk([span])))
        return tree

    async def loaded_models(self) -> dict[str, Any]:
        listed = await super().loaded_models()
        for m in listed["models"]:
            for key, seconds in (("idle_s", 42.0), ("loaded_for_s", 60.0), ("unloads_in_s", 258.0)):
                if m[key] is not None:
                    m[key] = seconds
        return listed

    async def keys(self) -> dict[str, Any]:
        listed = await super().keys()
        for k in listed["keys"]:
            k["id"] = self._pin(k["id"], "key_", 12)
        return listed

    async def create_key(self, tenant: str, app: str, user: str, role: str) -> dict[str, Any]:
        made = await super().create_key(tenant, app, user, role)
        made["id"] = self._pin(made["id"], "key_", 12)
        made["secret"] = "apl-" + base64.urlsafe_b64encode(hashlib.sha256(made["id"].encode()).digest()).decode().rstrip("=")
        return made


def _walk(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A span tree's spans in the order the timeline draws them."""
    return [s for span in spans for s in (span, *_walk(span["children"]))]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A priced model with a global and a tenant budget, one answer from the model, the same
    question again from the cache, and a call for a model that is not there."""
    server = start_server(tmp_path_factory.mktemp("tui-snapshots"),
                          config_text(embeddings=False, cache="enabled = true\nsweep_interval_s = 0", price_in=0.15, price_out=0.6))
    for budget in ({"level": "global", "name": "*", "usd": 100, "period": "month"}, {"level": "tenant", "name": "local", "usd": 5, "period": "day"}):
        httpx.put(f"{server.base_url}/admin/budgets", json=budget, timeout=10).raise_for_status()
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "What is the capital of Peru?"}], "max_tokens": 6, "temperature": 0}
    for _ in range(2):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "model": "no-such-model"}, timeout=60).status_code == 404
    server.wait_idle()
    deadline = time.monotonic() + 20
    while len(httpx.get(f"{server.base_url}/admin/traces", timeout=10).json()["traces"]) < 3:  # traces are written behind the answers
        assert time.monotonic() < deadline, "the three traces were never written"
        time.sleep(0.2)
    yield server
    stop_server(server)


def tui(server: Server) -> ApplianceTUI:
    app = ApplianceTUI(server.base_url, None, interval_s=60)  # one poll per screen shown: rates and sparkline hold still
    app.client = PinnedClient(server.base_url)
    return app


def keys(text: str) -> list[str]:
    return ["space" if c == " " else c for c in text]


def text_of(app: ApplianceTUI, selector: str) -> str:
    return str(app.query_one(selector, Static).render())


def rows(app: ApplianceTUI, selector: str) -> int:
    """The table's rows once it has laid them out, else -1: a DataTable measures its columns when its
    message queue is next empty, so a snapshot taken between a row's arrival and that moment draws the
    new row in the old widths ("ke" for a key id; seen once in a full suite on a busy machine)."""
    table = app.query_one(selector, DataTable)
    for index, column in enumerate(table.ordered_columns):
        widest = max((cell_len(str(table.get_row_at(r)[index])) for r in range(table.row_count)), default=0)
        if column.content_width < widest:
            return -1
    return table.row_count


async def until(pilot, shown: Callable[[], bool]) -> None:  # type: ignore[no-untyped-def]
    for _ in range(200):
        await pilot.pause(0.05)
        if shown():
            return
    raise AssertionError("the screen never showed the server's data")


def steps(*groups: tuple[tuple[str, ...], Callable[[ApplianceTUI], bool]]):  # type: ignore[no-untyped-def]
    """Press each group of keys, then wait until the live data it should bring is on screen."""
    async def run(pilot) -> None:  # type: ignore[no-untyped-def]
        app = pilot.app
        await until(pilot, lambda: app.connected)
        for presses, shown in groups:
            await pilot.press(*presses)
            await until(pilot, lambda: shown(app))
        app.clear_notifications()  # a toast fades on its own clock: the snapshot is taken without one
        await pilot.pause(0.2)
    return run


SCREENS = {
    "overview": steps(((), lambda app: CHAT_MODEL in text_of(app, "#overview-models") and "TTFT p50 100–250 ms" in text_of(app, "#overview-body")
                       and text_of(app, "#chart-ttft-now") == "175 ms")),
    "budgets": steps((("2",), lambda app: "local" in str(app.query_one("#budget-tree").root.children[0].children[0].label))),  # type: ignore[attr-defined]
    "cache-search": steps((("3",), lambda app: rows(app, "#cache-buckets") == 1),
                          (("slash", *keys("Peru"), "enter"), lambda app: rows(app, "#cache-entries") == 1)),
    "traces-timeline": steps((("4",), lambda app: rows(app, "#trace-table") == 3),
                             (("down", "down", "enter"), lambda app: "budget.settle" in text_of(app, "#trace-timeline"))),
    # the failed call alone, why it failed, and the filter said above the table
    "traces-errors": steps((("4",), lambda app: rows(app, "#trace-table") == 3),
                           (("f",), lambda app: rows(app, "#trace-table") == 1 and "errors only" in text_of(app, "#trace-filter")),
                           (("enter",), lambda app: "model_not_found" in text_of(app, "#trace-timeline"))),
    "models": steps((("6",), lambda app: rows(app, "#model-table") == 1 and "KV" in text_of(app, "#slots"))),
}


@pytest.mark.parametrize("screen", SCREENS)
def test_every_screen_at_80_by_24(snap_compare, served: Server, screen: str) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(tui(served), terminal_size=(80, 24), run_before=SCREENS[screen])


def test_a_new_keys_secret_at_80_by_24(snap_compare, served: Server) -> None:  # type: ignore[no-untyped-def]
    """The only test here that makes a key: the keys table behind the dialog shows just this one."""
    shown = steps((("5", "n", *keys("acme web ann dev"), "enter"), lambda app: isinstance(app.screen, SecretScreen) and rows(app, "#key-table") == 1))
    assert snap_compare(tui(served), terminal_size=(80, 24), run_before=shown)


def test_a_prompt_at_80_by_24(snap_compare, served: Server) -> None:  # type: ignore[no-untyped-def]
    shown = steps((("6",), lambda app: rows(app, "#model-table") == 1),
                  (("a",), lambda app: isinstance(app.focused, Input)))
    assert snap_compare(tui(served), terminal_size=(80, 24), run_before=shown)
