"""The operator's terminal UI (Textual): overview, budgets, cache, traces, keys and models, over the admin
HTTP API. Data is polled by one exclusive worker, so a slow refresh never piles up; when the
server is down the banner says so and the next poll reconnects."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.logging import TextualHandler
from textual.reactive import var
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Header, Input, Static, TabbedContent, TabPane, Tree

from tui import overview, views
from tui.client import AdminClient, AdminError
from tui.money import money
from tui.widgets import Charts, SecretScreen

PROMPTS = {
    "key": "new key: TENANT APP USER ROLE",
    "budget": "budget: LEVEL NAME USD PERIOD, e.g. tenant acme 5 day (global - 100 month)",
    "search": "search cache entries: TEXT",
    "traces": "show traces whose tenant or model contains: TEXT (empty: all)",
    "adapter": "load adapter: MODEL NAME PATH [SCALE]",
    "quantize": "quantize: SOURCE TYPE [requantize]   (SOURCE an alias or a path on the server, TYPE e.g. Q4_K_M)",
    "pull": "pull from the hub: REPO FILE.gguf",
    "train": "train an adapter: STUDENT DATA [NAME] [at HH:MM]   (DATA a JSONL file or an export folder on the server)",
    "add_model": "add a model file on the server: PATH [ALIAS] [like MODEL]",
    "remove": "remove {word} from models.toml (its file stays): type {word} to confirm",
    "revoke": "revoke key {word}{detail}: type {word} to confirm",
    "invalidate": "invalidate cache bucket {word} ({detail}): type {word} to confirm",
}
# What a confirmed prompt does, in the words of "… was not <done>" when the typed word is wrong.
CONFIRMED = {"remove": "removed", "revoke": "revoked", "invalidate": "invalidated"}

# Each table's columns, as first shown (the fitted ones are laid out again with each fill).
COLUMNS = {"#cache-buckets": views.CACHE_COLUMNS, "#cache-entries": views.ENTRY_COLUMNS, "#trace-table": views.TRACE_COLUMNS,
           "#key-table": ("id", "tenant", "app", "user", "role", "admin", "state"), "#model-table": views.MODEL_COLUMNS,
           "#adapter-table": ("model", "adapter", "scale", "requests", "path")}
# The screen each action belongs to: the footer lists, and the keys run, only the current screen's.
ASKED_ON = {"key": "keys", "budget": "budgets", "search": "cache", "traces": "traces",
            "adapter": "models", "quantize": "models", "pull": "models", "train": "models", "add_model": "models",
            "remove": "models", "revoke": "keys", "invalidate": "cache"}
ACTION_ON = {"unload": "models", "load_model": "models", "unload_model": "models", "remove_model": "models", "stop_job": "models",
             "revoke": "keys", "invalidate": "cache", "mark": "cache", "cycle_filter": "traces", "clear_filters": "traces",
             "edit_budget": "budgets"}
# What takes the keys when a screen is shown, so Enter and the arrows act on it at once.
FOCUS_ON = {"budgets": "#budget-tree", "cache": "#cache-buckets", "traces": "#trace-table", "keys": "#key-table", "models": "#model-table"}
QUIET_LOGGERS = ("httpx", "httpcore")


@dataclass(frozen=True)
class Confirm:
    """An action that waits until the operator types `word` (the row's name, as the table shows it)."""

    word: str
    detail: str  # what the prompt adds about the row
    call: Callable[[], Awaitable[dict[str, Any]]]
    said: Callable[[dict[str, Any]], str]


class ApplianceTUI(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "appliance"
    # 1-6 are priority bindings, so no focused widget can take them (check_action hands them to a
    # text input); the tab titles carry the digits, which leaves the footer to each screen's keys.
    BINDINGS = [
        Binding("1", "show('overview')", "Overview", show=False, priority=True),
        Binding("2", "show('budgets')", "Budgets", show=False, priority=True),
        Binding("3", "show('cache')", "Cache", show=False, priority=True),
        Binding("4", "show('traces')", "Traces", show=False, priority=True),
        Binding("5", "show('keys')", "Keys", show=False, priority=True),
        Binding("6", "show('models')", "Models", show=False, priority=True),
        # The Models screen: its footer has room for the model keys; the adapter and job keys are
        # named above their own sections. A key bound twice acts on the screen its check_action allows.
        Binding("l", "load_model", "Load"),
        Binding("o", "unload_model", "Unload"),
        Binding("a", "ask('adapter')", "Load adapter", show=False),
        Binding("u", "unload", "Unload adapter", show=False),
        Binding("z", "ask('quantize')", "Quantize", show=False),
        Binding("p", "ask('pull')", "Pull", show=False),
        Binding("T", "ask('train')", "Train adapter", show=False),
        Binding("s", "stop_job", "Stop job", show=False),
        Binding("n", "ask('key')", "New key"),
        Binding("n", "ask('add_model')", "Add model"),
        Binding("d", "revoke", "Revoke"),
        Binding("e", "edit_budget", "Edit budget"),
        Binding("slash", "ask('search')", "Search"),
        Binding("i", "invalidate", "Invalidate"),
        Binding("v", "mark('verified')", "Verify"),
        Binding("x", "mark('rejected')", "Reject"),
        Binding("x", "remove_model", "Remove model"),
        Binding("f", "cycle_filter", "Status filter"),
        Binding("t", "ask('traces')", "Text filter"),
        Binding("c", "clear_filters", "Clear filters"),
        Binding("r", "refresh", "Refresh"),
        Binding("q", "quit", "Quit"),
        Binding("escape", "cancel_prompt", "Cancel", show=False),
    ]
    tab: var[str] = var("overview", init=False)

    def __init__(self, base_url: str, key: str | None, interval_s: float = 2.0) -> None:
        super().__init__()
        self.client = AdminClient(base_url, key)
        self.interval_s = interval_s
        self.samples: list[overview.Sample] = []
        self.series = overview.Series()  # what the overview's charts draw
        self.asking: str | None = None
        self.trace_filter = "all"
        self.trace_text = ""
        self.entries: list[dict[str, Any]] = []  # the last cache search's answer, as the entries table shows it
        self.fleet: list[views.FleetRow] = []  # the models table's rows, to act on the one under the cursor
        self.confirming: Confirm | None = None  # what `x`, `d` or `i` asked to do, until its row's name is typed
        self.own_key: str | None = None  # the id of the key this TUI signs in with, as the server says
        self.connected = False
        self._logging: tuple[list[logging.Handler], dict[str, int]] | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("connecting…", id="status")
        with TabbedContent(initial="overview"):
            with TabPane("1 Overview", id="overview"):
                yield Static(id="overview-body")
                yield Charts(id="charts")
                yield Static(id="overview-models")
            with TabPane("2 Budgets", id="budgets"):
                yield Tree("budgets", id="budget-tree")
            with TabPane("3 Cache", id="cache"):
                yield Static(id="cache-summary")
                yield DataTable(id="cache-buckets", cursor_type="row")
                yield DataTable(id="cache-entries", cursor_type="row")
            with TabPane("4 Traces", id="traces"):
                yield Static(id="trace-filter", markup=False)
                yield DataTable(id="trace-table", cursor_type="row")
                yield Static(id="trace-timeline", markup=False)
            with TabPane("5 Keys", id="keys"):
                yield DataTable(id="key-table", cursor_type="row")
            with TabPane("6 Models", id="models"):
                yield DataTable(id="model-table", cursor_type="row")
                yield Static(id="memory")
                yield Static(id="slots")
                yield Static("adapters (a load, u unload the selected one)", id="adapters-title")
                yield DataTable(id="adapter-table", cursor_type="row")
                yield Static(id="jobs")
        # Disabled while hidden: never takes focus or keys. What it opens with is kept, not selected, so typing adds to it.
        yield Input(id="prompt", classes="hidden", disabled=True, select_on_focus=False)
        yield Footer(show_command_palette=False)  # its room goes to the screen's own keys

    def on_mount(self) -> None:
        self._log_to_textual()
        for table_id, columns in COLUMNS.items():
            self.query_one(table_id, DataTable).add_columns(*columns)
        self.poll()
        self.set_interval(self.interval_s, self.poll)

    # -- data ----------------------------------------------------------------------------------

    @work(exclusive=True, group="poll")
    async def poll(self) -> None:
        try:
            await self._refresh()
        except NoMatches:
            pass  # a poll that outlived its screen (the app is closing): nothing is left to draw

    async def _refresh(self) -> None:
        try:
            text = await self.client.metrics()
            budgets = await self.client.budgets()
            self._connected(True)
            sample = overview.parse_metrics(text, time.monotonic())
            previous = self.samples[-1] if self.samples else None
            self.samples = (self.samples + [sample])[-120:]
            shown = overview.overview(sample, previous, budgets)
            self.series = self.series.add(shown)
            self._render_overview(shown)
            self._render_budgets(budgets)
            active = self.tab
            if active == "cache":
                self._render_cache(await self.client.cache())
            elif active == "traces":
                self._render_traces(await self.client.traces())
            elif active == "keys":
                self._render_keys(await self.client.keys())
            elif active == "models":
                self._render_models(await self.client.models(), await self.client.loaded_models(), await self.client.jobs())
        except httpx.HTTPError:
            self._connected(False)
        except AdminError as exc:
            if exc.status in (401, 403):
                self._refused(exc)
            else:
                self.query_one("#status", Static).update(f"[b]{escape(exc.message)}[/b]")

    def _refused(self, exc: AdminError) -> None:
        """The server no longer takes this TUI's key (revoked, expired, not admin): say so, and clear
        every screen rather than go on showing what was true before."""
        status = self.query_one("#status", Static)
        status.update(f"[b]the server refuses this TUI's key ({exc.status}: {escape(exc.message)})[/b]: "
                      "start it again with a working admin key")
        status.set_class(True, "down")
        for table in self.query(DataTable):
            table.clear()
        self.fleet, self.entries, self.series = [], [], overview.Series()
        self.query_one("#budget-tree", Tree).clear()
        self.query_one(Charts).show(self.series)
        for shown in ("#overview-body", "#overview-models", "#cache-summary", "#trace-filter", "#trace-timeline", "#memory", "#slots", "#jobs"):
            self.query_one(shown, Static).update("")

    def _connected(self, ok: bool) -> None:
        status = self.query_one("#status", Static)
        if ok:
            status.update(f"connected to {self.client.base_url}")
            status.set_class(False, "down")
        else:
            status.update(f"[b]server unreachable at {self.client.base_url}[/b]: retrying every {self.interval_s:g} s")
            status.set_class(True, "down")
        self.connected = ok

    def _render_overview(self, o: overview.Overview) -> None:
        self.query_one("#overview-body", Static).update("\n".join(overview.overview_lines(o)))
        self.query_one(Charts).show(self.series)
        self.query_one("#overview-models", Static).update("\n".join(overview.model_lines(o)))

    def _render_budgets(self, budgets: dict[str, Any]) -> None:
        tree = self.query_one("#budget-tree", Tree)
        root = views.budget_tree(budgets)
        tree.clear()  # the cursor stays on its line: `e` reads the node there now
        tree.root.set_label(f"{root.label}: {root.detail}")
        tree.root.data = root.edit

        def add(parent: Any, node: views.BudgetNode) -> None:
            label = f"{node.label}: {node.detail}"
            branch = parent.add(label, data=node.edit, expand=True) if node.children else parent.add_leaf(label, data=node.edit)
            for child in node.children:
                add(branch, child)

        for child in root.children:
            add(tree.root, child)
        tree.root.expand()

    def _render_cache(self, stats: dict[str, Any]) -> None:
        s = stats["since_start"]
        rate = "–" if s["hit_rate"] is None else f"{s['hit_rate']:.0%}"
        verified = "–" if s["cost_weighted_verified_hit_rate"] is None else f"{s['cost_weighted_verified_hit_rate']:.0%}"
        self.query_one("#cache-summary", Static).update(
            f"hits {s['lookups']['hit']:.0f}  misses {s['lookups']['miss']:.0f}  hit rate {rate}  verified cost-weighted {verified}  "
            f"false hits {s['false_hits_reported']:.0f}\n{views.false_hit_line(stats)}")
        _fill(self.query_one("#cache-buckets", DataTable), views.cache_rows(stats))

    def _render_entries(self) -> None:
        table = self.query_one("#cache-entries", DataTable)
        rows = views.entry_rows(self.entries)
        _fill(table, views.fit(views.ENTRY_COLUMNS, rows, self._room(table, len(rows)), views.ENTRY_SHRINK), views.ENTRY_COLUMNS)

    def _render_traces(self, traces: dict[str, Any]) -> None:
        table = self.query_one("#trace-table", DataTable)
        found = views.trace_rows(traces, self.trace_filter, self.trace_text)
        self.query_one("#trace-filter", Static).update(
            views.trace_filter_line(self.trace_filter, self.trace_text, len(found), len(traces.get("traces", []))))
        rows = views.fit(views.TRACE_COLUMNS, [cells for _, cells in found], self._room(table, len(found)), views.TRACE_SHRINK)
        _fill(table, rows, views.TRACE_COLUMNS, [trace_id for trace_id, _ in found])

    def _render_keys(self, keys: dict[str, Any]) -> None:
        self.own_key = keys.get("caller")
        _fill(self.query_one("#key-table", DataTable), views.key_rows(keys))

    def _render_models(self, models: dict[str, Any], loaded: dict[str, Any], jobs: dict[str, Any]) -> None:
        self.fleet = views.fleet_rows(models, loaded)
        table = self.query_one("#model-table", DataTable)
        rows = views.fit(views.MODEL_COLUMNS, [row.cells for row in self.fleet], self._room(table, len(self.fleet)), views.MODEL_SHRINK)
        _fill(table, rows, views.MODEL_COLUMNS)
        self.query_one("#memory", Static).update(views.memory_line(loaded))
        self.query_one("#slots", Static).update("\n".join(views.slot_lines(models, loaded)))
        _fill(self.query_one("#adapter-table", DataTable), views.adapter_rows(models))
        lines = views.job_lines(jobs, 24)
        self.query_one("#jobs", Static).update("\n".join(["jobs (z quantize, p pull, T train, s stop)", *lines]) if lines
                                                else "no jobs (z quantize, p pull, T train)")

    def _room(self, table: DataTable, rows: int) -> int:
        """The columns a table's cells may take at the terminal's size: its width, less its
        scrollbar when the rows overflow it (before its first layout, the screen's width)."""
        width = table.size.width or self.size.width
        if rows + 1 > table.size.height:  # the header is a row too
            width -= table.styles.scrollbar_size_vertical
        return width

    # -- actions -------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if isinstance(self.screen, ModalScreen):
            return False  # a dialog is answered first
        if action == "show":
            return not isinstance(self.focused, Input)  # digits typed into the prompt stay digits
        home = ASKED_ON.get(str(parameters[0])) if action == "ask" and parameters else ACTION_ON.get(action)
        return home is None or home == self.tab

    def action_show(self, tab: str) -> None:
        self.tab = tab
        self.poll()

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self.tab = event.pane.id or self.tab  # a tab clicked with the mouse, or a pane given focus

    def watch_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        self._focus_tab()
        self.refresh_bindings()

    def _focus_tab(self) -> None:
        """Focus on the shown screen's table or tree. Focus left in a hidden pane would pull its
        tab back to the front (TabbedContent shows the pane that holds the focus)."""
        target = FOCUS_ON.get(self.tab)
        if target is None:
            self.set_focus(None)
        else:
            self.query_one(target).focus()

    def action_refresh(self) -> None:
        self.poll()

    def action_ask(self, what: str, value: str = "") -> None:
        """Open the prompt for `what`, with `value` typed in already."""
        prompt = self.query_one("#prompt", Input)
        self.asking = what
        confirming = self.confirming
        prompt.placeholder = PROMPTS[what].format(word=confirming.word, detail=confirming.detail) if confirming else PROMPTS[what]
        prompt.value = value
        prompt.cursor_position = len(value)
        prompt.border_title = prompt.placeholder if value else None  # the words still to type, above what is filled in
        prompt.disabled = False
        prompt.remove_class("hidden")
        self.add_class("-asking")  # toasts rise above the prompt (app.tcss)
        prompt.focus()

    def action_cancel_prompt(self) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.add_class("hidden")
        prompt.disabled = True
        self.remove_class("-asking")
        self.asking = self.confirming = None
        self._focus_tab()

    def action_edit_budget(self) -> None:
        """The budget prompt, filled in from the row under the cursor: its level, name, limit and period."""
        tree = self.query_one("#budget-tree", Tree)
        node = tree.get_node_at_line(tree.cursor_line) if tree.cursor_line >= 0 else None
        self.action_ask("budget", str(node.data or "") if node is not None else "")

    def action_cycle_filter(self) -> None:
        self.trace_filter = {"all": "error", "error": "ok", "ok": "all"}[self.trace_filter]
        self.notify(f"traces: {self.trace_filter}")
        self.poll()

    def action_clear_filters(self) -> None:
        self.trace_filter, self.trace_text = "all", ""
        self.poll()

    @on(Input.Submitted, "#prompt")
    async def submitted(self, event: Input.Submitted) -> None:
        what, words, confirming = self.asking, event.value.split(), self.confirming
        self.action_cancel_prompt()
        try:
            if what == "key" and len(words) == 4:
                made = await self.client.create_key(*words)
                self.action_show("keys")
                self.push_screen(SecretScreen(made["id"], "/".join(words[:3]) + f" ({words[3]})", made["secret"]))
            elif what == "budget":
                edit = views.budget_args(event.value)
                if isinstance(edit, str):
                    self.notify(edit, severity="warning")
                else:
                    await self.client.set_budget(edit.level, edit.name, edit.usd, edit.period)
                    self.notify(f"{edit.level} {edit.name}: {money(edit.usd)} per {edit.period}")
            elif what == "traces":
                self.trace_text = " ".join(words)
                self.action_show("traces")
            elif what == "search" and words:
                self.entries = (await self.client.cache_entries(" ".join(words)))["entries"]
                self._render_entries()
                self.action_show("cache")
                self.query_one("#cache-entries", DataTable).focus()  # v and x act on the entry under the cursor
            elif what == "adapter" and len(words) in (3, 4):
                try:
                    scale = float(words[3]) if len(words) == 4 else 1.0
                except ValueError:
                    self.notify(f"'{words[3]}' is not a scale: write a number, e.g. 0.5", severity="warning")
                    return
                await self.client.load_adapter(words[0], words[1], words[2], scale)
                self.notify(f"{words[0]}: adapter {words[1]} loaded")
                self.action_show("models")
            elif what == "quantize" and len(words) in (2, 3):
                job = await self.client.quantize(words[0], words[1].upper(), allow_requantize=len(words) == 3 and words[2] == "requantize")
                self.notify(f"quantize job {job['job']['id']} started")
                self.action_show("models")
            elif what == "pull" and len(words) == 2:
                job = await self.client.pull(words[0], words[1])
                self.notify(f"pull job {job['job']['id']} started")
                self.action_show("models")
            elif what == "train" and (asked := views.train_args(words)) is not None:
                job = await self.client.train(*asked)
                self.notify(f"train job {job['job']['id']} started: {job['examples']} examples, {job['steps']} steps"
                            + (" (resuming)" if job["resume"] else ""))
                self.action_show("models")
            elif what == "add_model" and (added := views.add_model_args(event.value)) is not None:
                self.notify(f"adding {added[0]}…")
                self._change(lambda: self.client.add_model(*added), lambda done: f"{done['alias']} added to models.toml, served now")
            elif what in CONFIRMED and confirming is not None:
                if event.value.strip() != confirming.word:
                    self.notify(f"{confirming.word} was not {CONFIRMED[what]}: type {confirming.word} to confirm", severity="warning")
                else:
                    self._change(confirming.call, confirming.said)
            else:
                self.notify(f"expected: {PROMPTS.get(what or '', '')}", severity="warning")
        except AdminError as exc:
            self.notify(exc.message, severity="error")
        self.poll()

    def _selected(self, tab: str, table_id: str) -> tuple[int, list[Any]] | None:
        """The cursor's row index and cells in a table, when its tab is showing and it has rows."""
        table = self.query_one(table_id, DataTable)
        if self.tab != tab or table.row_count == 0:
            return None
        return table.cursor_row, table.get_row_at(table.cursor_row)

    def _confirm(self, what: str, confirm: Confirm) -> None:
        self.confirming = confirm
        self.action_ask(what)

    def action_revoke(self) -> None:
        if (selected := self._selected("keys", "#key-table")) is None:
            return
        key_id = str(selected[1][0])
        own = " (the key this TUI signs in with: it stops working at once)" if key_id == self.own_key else ""
        self._confirm("revoke", Confirm(key_id, own, lambda: self.client.revoke_key(key_id), lambda _: f"revoked {key_id}"))

    async def action_stop_job(self) -> None:
        try:
            job = views.running_job(await self.client.jobs())
            if job is None:
                self.notify("no job is running", severity="warning")
            elif not job.get("cancellable"):
                self.notify(f"{job['kind']} job {job['id']} cannot be stopped", severity="warning")
            else:
                await self.client.stop_job(job["id"])
                self.notify(f"stopping {job['kind']} job {job['id']} at the end of its step")
        except AdminError as exc:
            self.notify(exc.message, severity="error")
        self.poll()

    async def action_unload(self) -> None:
        if (selected := self._selected("models", "#adapter-table")) is None:
            return
        alias, name = (str(v) for v in selected[1][:2])
        try:
            await self.client.unload_adapter(alias, name)
            self.notify(f"{alias}: adapter {name} unloaded")
        except AdminError as exc:
            self.notify(exc.message, severity="error")
        self.poll()

    def _selected_model(self) -> views.FleetRow | None:
        if (selected := self._selected("models", "#model-table")) is None or selected[0] >= len(self.fleet):
            return None
        row = self.fleet[selected[0]]
        if row.retired:
            self.notify(f"that is an old version of {row.alias} ending its requests: choose the model's row", severity="warning")
            return None
        return row

    def action_load_model(self) -> None:
        if (row := self._selected_model()) is not None:
            self.notify(f"loading {row.alias}…")
            self._change(lambda: self.client.load_model(row.alias), lambda done: f"{row.alias} loaded")

    def action_unload_model(self) -> None:
        if (row := self._selected_model()) is not None:
            self._change(lambda: self.client.unload_model(row.alias),
                         lambda done: f"{row.alias} " + ("unloads when its requests end" if done["when_idle"] else "unloaded"))

    def action_remove_model(self) -> None:
        if (row := self._selected_model()) is not None:
            alias = row.alias
            self._confirm("remove", Confirm(alias, "", lambda: self.client.remove_model(alias), lambda _: f"{alias} removed (its file stays)"))

    @work(group="fleet")
    async def _change(self, call: Callable[[], Awaitable[dict[str, Any]]], said: Callable[[dict[str, Any]], str]) -> None:
        """A change to the fleet, keys or cache, off the key handler: a load can take as long as the
        weights take to read, and the screen keeps polling meanwhile (the table shows it loading)."""
        try:
            self.notify(said(await call()))
        except AdminError as exc:
            self.notify(exc.message, severity="error")
        except httpx.HTTPError as exc:
            self.notify(f"no answer from {self.client.base_url}: {exc}", severity="error")
        self.poll()

    async def action_invalidate(self) -> None:
        if (selected := self._selected("cache", "#cache-buckets")) is None:
            return
        shown, tenant, _, model, entries = (str(cell) for cell in selected[1][:5])
        try:  # the table shows a bucket's first characters: the whole name is the server's
            bucket = next((b["bucket"] for b in (await self.client.cache())["buckets"] if b["bucket"].startswith(shown)), None)
        except AdminError as exc:
            self.notify(exc.message, severity="error")
            return
        if bucket is None:
            self.notify(f"bucket {shown} is gone", severity="warning")
            return
        self._confirm("invalidate", Confirm(shown, f"{entries} entries, tenant {tenant}, model {model}",
                                            lambda: self.client.invalidate(bucket=bucket), lambda done: f"invalidated {done['invalidated']} entries"))

    async def action_mark(self, state: str) -> None:
        if (selected := self._selected("cache", "#cache-entries")) is None:
            return
        entry_id = int(str(selected[1][0]))
        try:
            done = await self.client.mark_entry(entry_id, state)
        except AdminError as exc:
            self.notify(exc.message, severity="error")
            return
        # The row says what the server now holds, without another search.
        self.entries = [{**e, "state": done["state"]} if e["id"] == done["id"] else e for e in self.entries]
        self._render_entries()
        self.notify(f"entry {entry_id}: {done['state']}")

    @on(DataTable.RowSelected, "#trace-table")
    async def open_trace(self, event: DataTable.RowSelected) -> None:
        trace_id = str(event.row_key.value)  # the row shows its first characters
        try:
            tree = await self.client.trace(trace_id)
        except AdminError as exc:
            self.notify(exc.message, severity="error")
            return
        self.query_one("#trace-timeline", Static).update("\n".join([f"trace {trace_id}", *views.timeline(tree, 30)]))

    def _log_to_textual(self) -> None:
        """While Textual owns the terminal, a log handler writing to stderr draws over the screen
        (the CLI's basicConfig, and httpx logs each poll at INFO): route records to Textual's log."""
        root = logging.getLogger()
        self._logging = (root.handlers[:], {name: logging.getLogger(name).level for name in QUIET_LOGGERS})
        root.handlers = [TextualHandler()]
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)

    async def on_unmount(self) -> None:
        await self.client.close()
        if self._logging is not None:
            handlers, levels = self._logging
            logging.getLogger().handlers = handlers
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _fill(table: DataTable, rows: list[tuple[str, ...]], columns: tuple[str, ...] | None = None, keys: list[str] | None = None) -> None:
    """Replace the rows, keeping the cursor where it was. `columns` are added again, so that each
    is as wide as its cells are now (a DataTable only ever widens a column). Cells are plain text:
    a DataTable reads a string as markup, and a cached answer's "[/x]" would stop the screen."""
    cursor = table.cursor_row
    table.clear(columns=columns is not None)
    if columns is not None:
        table.add_columns(*columns)
    for n, row in enumerate(rows):
        table.add_row(*(Text(cell, end="") for cell in row), key=keys[n] if keys is not None else None)
    if rows:
        table.move_cursor(row=min(cursor, len(rows) - 1))


def run(base_url: str, key: str | None) -> None:
    ApplianceTUI(base_url, key).run()
