"""Snapshot tests of the TUI at 80×24: the layout of every screen, compared with SVG snapshots in
tests/__snapshots__ (pytest-textual-snapshot; `--snapshot-update` after a deliberate change).

The screens are taken with no server behind them (the discard port), the one state whose every
character is fixed; what real data looks like is checked by the pilot tests in test_tui.py."""

from __future__ import annotations

import pytest

from tui.app import ApplianceTUI

NO_SERVER = "http://127.0.0.1:9"  # the discard port: nothing listens, every poll fails the same way


async def _wait_for_the_banner(pilot) -> None:  # type: ignore[no-untyped-def]
    for _ in range(100):
        await pilot.pause(0.05)
        if not pilot.app.connected and "unreachable" in str(pilot.app.query_one("#status").render()):
            return


@pytest.mark.parametrize("tab", ["1", "2", "3", "4", "5", "6"])
def test_every_screen_at_80_by_24(snap_compare, tab: str) -> None:  # type: ignore[no-untyped-def]
    app = ApplianceTUI(NO_SERVER, None, interval_s=60)
    assert snap_compare(app, press=[tab], terminal_size=(80, 24), run_before=_wait_for_the_banner)


def test_a_prompt_at_80_by_24(snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = ApplianceTUI(NO_SERVER, None, interval_s=60)
    assert snap_compare(app, press=["6", "a"], terminal_size=(80, 24), run_before=_wait_for_the_banner)
