"""What an operator found wrong in the console, each checked with Textual's pilot at 80x24 against a
real server in keys mode: two tenants who asked the same question, a call that failed, a priced
model with a long alias that loads on demand and unloads after 10 idle minutes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from textual.widgets import DataTable, Footer, Input, Sparkline, Static, Tree
from textual.widgets._toast import Toast

from tests.conftest import CHAT_MODEL, Server, config_text, start_server, stop_server
from tests.test_gate_api import new_key
from tests.test_tui import keys, settle, text_of, toasts
from tui import overview
from tui.app import ApplianceTUI

LONG_ALIAS = "smollm2-135m-instruct-for-the-console-tests"  # wider than the models table leaves at 80 columns
PERU = "What is the capital of Peru?"


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    config = config_text(embeddings=False, auth="keys", cache="enabled = true\nsweep_interval_s = 0", price_in=0.15, price_out=0.6,
                         model_extra='preload = false\nkeep_alive = "10m"')
    config = config.replace("[auth.open_principal]\nadmin = true\n", "").replace(f'alias = "{CHAT_MODEL}"', f'alias = "{LONG_ALIAS}"')
    server = start_server(tmp_path_factory.mktemp("tui-operator"), config)
    secrets = {"acme": new_key(server, "acme", user="ann"), "globex": new_key(server, "globex", user="bob")}
    for tenant in ("acme", "globex"):  # the same question from two tenants: one cache entry each
        chat(server, secrets[tenant], PERU).raise_for_status()
    assert chat(server, secrets["acme"], PERU, model="no-such-model").status_code == 404
    yield {"server": server, "admin": new_key(server, "ops", user="op", admin=True), **secrets}
    stop_server(server)


def chat(server: Server, secret: str, question: str, model: str = LONG_ALIAS) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}, timeout=120)


def admin_get(console: dict[str, Any], path: str, **params: str) -> Any:
    response = httpx.get(f"{console['server'].base_url}{path}", params=params, headers={"Authorization": f"Bearer {console['admin']}"}, timeout=10)
    return response.json() if path.startswith("/admin") else response.text


def cells(table: DataTable, row: int) -> list[str]:
    return [str(c) for c in table.get_row_at(row)]


def fits(table: DataTable) -> bool:
    """Every column on screen: nothing to scroll sideways, so no scrollbar is drawn over the last row."""
    return table.max_scroll_x == 0 and table.virtual_size.width <= table.size.width


async def test_a_cache_search_tells_tenants_apart_and_verify_shows_at_once(console: dict[str, Any]) -> None:
    app = ApplianceTUI(console["server"].base_url, console["admin"], interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3", "slash", *keys("Peru"), "enter")
        entries = app.query_one("#cache-entries", DataTable)
        await settle(pilot, app, lambda: entries.row_count == 2)
        stored = {str(e["id"]): e for e in admin_get(console, "/admin/cache/entries", q="Peru")["entries"]}
        shown = [cells(entries, r) for r in range(2)]
        assert [str(c.label) for c in entries.ordered_columns] == ["id", "state", "hits", "tenant", "question", "answer"]
        assert sorted(row[3] for row in shown) == ["acme", "globex"]
        for row in shown:
            entry = stored[row[0]]
            assert row[3] == entry["tenant"] and row[4] == PERU and entry["answer"].startswith(row[5].rstrip("…")) and len(row[5]) >= 10
        assert fits(entries)
        entries.focus()
        await pilot.press("v")
        await settle(pilot, app, lambda: cells(entries, 0)[1] == "verified", timeout=2)  # from the server's reply, not a restart
        assert cells(entries, 1)[1] == "unverified"  # the other tenant's entry is its own
        states = {str(e["id"]): e["state"] for e in admin_get(console, "/admin/cache/entries", q="Peru")["entries"]}
        assert states == {cells(entries, 0)[0]: "verified", cells(entries, 1)[0]: "unverified"}


async def test_traces_say_why_a_call_failed_and_which_filter_is_on(console: dict[str, Any]) -> None:
    app = ApplianceTUI(console["server"].base_url, console["admin"], interval_s=0.3)
    app.NOTIFICATION_TIMEOUT = 1.0  # the filter's toast fades within the test
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.press("4")
        table = app.query_one("#trace-table", DataTable)
        await settle(pilot, app, lambda: table.row_count >= 3)
        total = table.row_count
        failed = [cells(table, r) for r in range(total) if cells(table, r)[-1] != "ok"]
        assert [row[-1] for row in failed] == ["✗ model_not_found"] and failed[0][3] == "no-such-model"
        assert all(re.fullmatch(r"\d+ ms|\d+\.\d s|\d+ s", cells(table, r)[5]) for r in range(total))  # whole, not cut
        assert fits(table)
        assert text_of(app, "#trace-filter").startswith(f"all {total} traces")

        await pilot.press("f")
        await settle(pilot, app, lambda: table.row_count == 1 and "traces: error" in toasts(app))
        await pilot.press("t")
        prompt = app.query_one("#prompt", Input)
        shown = list(app.screen.query(Toast))
        assert shown and all(not toast.region.overlaps(prompt.region) for toast in shown)  # the toast stands above the prompt
        await pilot.press(*keys("no-such"), "enter")  # the model the failed call asked for
        await settle(pilot, app, lambda: not app.screen.query(Toast))  # the toast has faded: the line still says what is filtered
        assert text_of(app, "#trace-filter") == f"1 of {total} traces: errors only, tenant or model has 'no-such' · c clears"
        assert table.row_count == 1

        await pilot.press("c")
        await settle(pilot, app, lambda: table.row_count == total and text_of(app, "#trace-filter").startswith(f"all {total} traces"))
        await pilot.press("f")
        await settle(pilot, app, lambda: table.row_count == 1)
        await pilot.press("enter")
        await settle(pilot, app, lambda: "✗ chat no-such-model: model_not_found (HTTP 404)" in text_of(app, "#trace-timeline"))
        assert app.query_one("#trace-timeline", Static).region.bottom <= app.query_one(Footer).region.y


async def test_unloads_in_is_whole_at_80_columns_with_a_long_alias(console: dict[str, Any]) -> None:
    app = ApplianceTUI(console["server"].base_url, console["admin"], interval_s=0.5)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        table = app.query_one("#model-table", DataTable)
        await settle(pilot, app, lambda: table.row_count == 1)
        row = cells(table, 0)
        assert [str(c.label) for c in table.ordered_columns][-1] == "unloads in"
        assert re.fullmatch(r"(9m|10m)\d\ds", row[-1]), row  # loaded on demand, unloads 10 idle minutes on
        assert row[0].startswith("smollm2-135m") and row[0].endswith("…")  # the alias gives up room; the slot lines show it whole
        assert f"{LONG_ALIAS}  slots" in text_of(app, "#slots")
        assert fits(table)


async def test_ttft_shows_its_bucket_and_the_charts_follow_the_polls(console: dict[str, Any]) -> None:
    server, acme = console["server"], console["acme"]
    app = ApplianceTUI(server.base_url, console["admin"], interval_s=0.3)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app, lambda: len(app.series.tokens) >= 2)
        sample = overview.parse_metrics(admin_get(console, "/metrics"), 0.0)
        p50, p95 = (overview.bucket_text(overview.quantile_bucket(sample.ttft_buckets, q)) for q in (0.5, 0.95))
        assert re.fullmatch(r"≤[\d.]+ m?s|>[\d.]+ m?s|[\d.]+( ms)?–[\d.]+ m?s", p50), p50
        await settle(pilot, app, lambda: f"TTFT p50 {p50}   p95 {p95}" in text_of(app, "#overview-body"))

        await asyncio.to_thread(lambda: chat(server, acme, "Name a river in Peru.").raise_for_status())  # a miss: tokens, spend
        await settle(pilot, app, lambda: max(app.series.tokens) > 0 and max(app.series.spend) > 0, timeout=20)
        await asyncio.to_thread(lambda: chat(server, acme, "Name a river in Peru.").raise_for_status())  # the same again: a hit
        await settle(pilot, app, lambda: app.series.hits[-1] == 1.0 and min(app.series.hits) < 1.0, timeout=20)
        await pilot.pause(0.5)
        for key in ("tokens", "ttft", "queue", "spend", "hits"):
            chart = app.query_one(f"#chart-{key}", Sparkline)
            assert list(chart.data or []) == list(getattr(app.series, key)), key  # each chart draws its series
            now = app.query_one(f"#chart-{key}-now", Static)
            assert chart.region.width >= 40 and now.region.right <= 80 and now.region.bottom <= app.query_one(Footer).region.y, key
        assert max(app.query_one("#chart-tokens", Sparkline).data or [0]) > 0
        assert text_of(app, "#chart-hits-now") == "100%" and text_of(app, "#chart-spend-now").startswith("$")
        assert LONG_ALIAS in text_of(app, "#overview-models")


async def test_budget_edit_starts_from_the_row_and_says_what_is_wrong(console: dict[str, Any]) -> None:
    server = console["server"]
    app = ApplianceTUI(server.base_url, console["admin"], interval_s=0.5)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.press("2")
        tree = app.query_one("#budget-tree", Tree)

        def line_of(name: str) -> int:
            return next((i for i in range(tree.last_line + 1) if str(tree.get_node_at_line(i).label).startswith(f"{name}:")), -1)  # type: ignore[union-attr]

        # tenants without a limit are in the tree, with what they spent today
        await settle(pilot, app, lambda: line_of("acme") > 0 and line_of("globex") > 0)
        globex = str(tree.get_node_at_line(line_of("globex")).label)  # type: ignore[union-attr]
        assert re.fullmatch(r"globex: \$0\.0\d+ today, no limit", globex), globex
        tree.cursor_line = line_of("acme")
        await pilot.press("e")
        prompt = app.query_one("#prompt", Input)
        assert prompt.value == "tenant acme "
        await pilot.press(*keys("five day"), "enter")
        await settle(pilot, app, lambda: "'five' is not an amount of dollars: write e.g. 5 or 0.25" in toasts(app))
        assert "could not convert" not in toasts(app) and "\n" not in toasts(app).strip()
        assert admin_get(console, "/admin/budgets")["budgets"] == []

        await pilot.press("e", *keys("2.5 week"), "enter")
        await settle(pilot, app, lambda: "'week' is not a period: write day, month or total" in toasts(app))
        await pilot.press("e", *keys("2.5 day"), "enter")
        await settle(pilot, app, lambda: re.search(r"acme: \$0\.0\d+ of \$2\.50 per day", str(tree.get_node_at_line(max(0, line_of("acme"))).label)) is not None)
        assert [(b["level"], b["name"], b["limit_usd"], b["period"]) for b in admin_get(console, "/admin/budgets")["budgets"]] == [
            ("tenant", "acme", 2.5, "day")]
        tree.cursor_line = line_of("acme")
        await pilot.press("e")
        assert prompt.value == "tenant acme 2.5 day"  # the row's own limit and period, to change
        await pilot.press("escape")
