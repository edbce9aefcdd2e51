"""The TUI's irreversible keys ask first, and the operator cannot lock the TUI out unawares: `d`
(revoke a key) and `i` (invalidate a cache bucket) act only once the row's name is typed, as `x`
(remove a model) does; `d` says when the key is the TUI's own; the last active admin key is refused;
and a TUI whose key the server refuses says so and clears its screens. Against a real server in
keys mode, each change checked through the API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from textual.widgets import DataTable, Input

from tests.conftest import CHAT_MODEL, Server, config_text, start_server, stop_server
from tests.test_gate_api import cli, new_key
from tests.test_tui import keys, settle, text_of, toasts
from tui.app import ApplianceTUI


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    config = config_text(embeddings=False, auth="keys", cache="enabled = true\nsweep_interval_s = 0")
    config = config.replace("[auth.open_principal]\nadmin = true\n", "").replace('mode = "keys"\n', 'mode = "keys"\nkey_cache_s = 0.2\n')
    server = start_server(tmp_path_factory.mktemp("tui-confirm"), config)
    member = new_key(server, "acme", user="ann")
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "What is the capital of Peru?"}], "max_tokens": 6, "temperature": 0}
    for _ in range(2):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {member}"}, timeout=60)
    yield {"server": server, "first": new_key(server, "ops", user="first", admin=True), "second": new_key(server, "ops", user="second", admin=True)}
    stop_server(server)


def api(server: Server, secret: str, path: str) -> Any:
    return httpx.get(f"{server.base_url}{path}", headers={"Authorization": f"Bearer {secret}"}, timeout=10).json()


def key_row(server: Server, secret: str, user: str) -> dict[str, Any]:
    return next(k for k in api(server, secret, "/admin/keys")["keys"] if k["user"] == user)


def prompt_of(app: ApplianceTUI) -> str:
    prompt = app.query_one("#prompt", Input)
    return prompt.placeholder if not prompt.disabled else ""


async def select(pilot, app: ApplianceTUI, table_id: str, first_cell: str) -> None:  # type: ignore[no-untyped-def]
    table = app.query_one(table_id, DataTable)
    await settle(pilot, app, lambda: any(str(table.get_row_at(i)[0]) == first_cell for i in range(table.row_count)))
    table.move_cursor(row=next(i for i in range(table.row_count) if str(table.get_row_at(i)[0]) == first_cell))


async def test_d_revokes_only_once_the_key_id_is_typed_and_the_tui_shows_its_own_key_refused(keyed: dict[str, Any]) -> None:
    server, first, second = keyed["server"], keyed["first"], keyed["second"]
    own = key_row(server, second, "first")["id"]
    app = ApplianceTUI(server.base_url, first, interval_s=0.3)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.press("5")
        await select(pilot, app, "#key-table", own)
        await pilot.press("d")
        assert f"revoke key {own}" in prompt_of(app) and "the key this TUI signs in with" in prompt_of(app)
        await pilot.press(*keys("yes"), "enter")  # the wrong word: nothing is revoked
        await settle(pilot, app, lambda: f"{own} was not revoked" in toasts(app))
        assert key_row(server, second, "first")["revoked_at"] is None

        await pilot.press("d", *keys(own), "enter")
        await settle(pilot, app, lambda: key_row(server, second, "first")["revoked_at"] is not None)
        # Its next poll is refused: the status line says so and the keys table is not left saying "active".
        await settle(pilot, app, lambda: "refuses this TUI's key (401" in text_of(app, "#status"))
        assert app.query_one("#key-table", DataTable).row_count == 0
        assert "revoked" in text_of(app, "#status")


async def test_the_last_active_admin_key_cannot_be_revoked_from_the_tui(keyed: dict[str, Any]) -> None:
    server, second = keyed["server"], keyed["second"]
    for other in api(server, second, "/admin/keys")["keys"]:
        if other["admin"] and other["user"] != "second" and other["revoked_at"] is None:
            cli(server, "keys", "revoke", other["id"])
    last = key_row(server, second, "second")["id"]
    app = ApplianceTUI(server.base_url, second, interval_s=0.3)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.press("5")
        await select(pilot, app, "#key-table", last)
        await pilot.press("d", *keys(last), "enter")
        await settle(pilot, app, lambda: "last active admin key" in toasts(app))
        assert key_row(server, second, "second")["revoked_at"] is None
        await pilot.pause(0.6)  # polls go on as before: the key still works
        assert "connected to" in text_of(app, "#status") and app.query_one("#key-table", DataTable).row_count >= 1


async def test_i_invalidates_a_bucket_only_once_its_name_is_typed(keyed: dict[str, Any]) -> None:
    server, second = keyed["server"], keyed["second"]

    def stale() -> int:
        return sum(b["stale"] or 0 for b in api(server, second, "/admin/cache")["buckets"])

    app = ApplianceTUI(server.base_url, second, interval_s=0.3)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.press("3")
        buckets = app.query_one("#cache-buckets", DataTable)
        await settle(pilot, app, lambda: buckets.row_count >= 1)
        shown = str(buckets.get_row_at(0)[0])
        await pilot.press("i")
        await settle(pilot, app, lambda: f"invalidate cache bucket {shown}" in prompt_of(app))
        await pilot.press(*keys("acme"), "enter")
        await settle(pilot, app, lambda: f"{shown} was not invalidated" in toasts(app))
        assert stale() == 0
        await pilot.press("i")
        await settle(pilot, app, lambda: bool(prompt_of(app)))
        await pilot.press(*keys(shown), "enter")
        await settle(pilot, app, lambda: "invalidated 1 entries" in toasts(app))
        assert stale() == 1
