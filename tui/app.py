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
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.logging import TextualHandler
from textual.reactive import var
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Header, Input, Static, TabbedContent, TabPane, Tree

from tui import views
from tui.client import AdminClient, AdminError

PROMPTS = {
    "key": "new key: TENANT APP USER ROLE",
    "budget": "budget: LEVEL NAME USD PERIOD   (LEVEL user|tenant|app|global, PERIOD day|month|total; NAME - for global)",
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

# The screen each action belongs to: the footer lists, and the keys run, only the current screen's.
ASKED_ON = {"key": "keys", "budget": "budgets", "search": "cache", "traces": "traces",
            "adapter": "models", "quantize": "models", "pull": "models", "train": "models", "add_model": "models",
            "remove": "models", "revoke": "keys", "invalidate": "cache"}
ACTION_ON = {"unload": "models", "load_model": "models", "unload_model": "models", "remove_model": "models", "stop_job": "models",
             "revoke": "keys", "invalidate": "cache", "mark": "cache", "cycle_filter": "traces"}
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
        Binding("e", "ask('budget')", "Edit budget"),
        Binding("slash", "ask('search')", "Search"),
        Binding("i", "invalidate", "Invalidate"),
        Binding("v", "mark('verified')", "Verify"),
        Binding("x", "mark('rejected')", "Reject"),
        Binding("x", "remove_model", "Remove model"),
        Binding("f", "cycle_filter", "Status filter"),
        Binding("t", "ask('traces')", "Text filter"),
        Binding("r", "refresh", "Refresh"),
        Binding("q", "quit", "Quit"),
        Binding("escape", "cancel_prompt", "Cancel", show=False),
    ]
    tab: var[str] = var("overview", init=False)

    def __init__(self, base_url: str, key: str | None, interval_s: float = 2.0) -> None:
        super().__init__()
        self.client = AdminClient(base_url, key)
        self.interval_s = interval_s
        self.samples: list[views.Sample] = []
        self.rates: list[float] = []
        self.asking: str | None = None
        self.trace_filter = "all"
        self.trace_text = ""
        self.entries: list[dict[str, Any]] = []
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
            with TabPane("2 Budgets", id="budgets"):
                yield Tree("budgets", id="budget-tree")
            with TabPane("3 Cache", id="cache"):
                yield Static(id="cache-summary")
                yield DataTable(id="cache-buckets", cursor_type="row")
                yield DataTable(id="cache-entries", cursor_type="row")
            with TabPane("4 Traces", id="traces"):
                yield DataTable(id="trace-table", cursor_type="row")
                yield Static(id="trace-timeline")
            with TabPane("5 Keys", id="keys"):
                yield DataTable(id="key-table", cursor_type="row")
            with TabPane("6 Models", id="models"):
                yield DataTable(id="model-table", cursor_type="row")
                yield Static(id="memory")
                yield Static(id="slots")
                yield Static("adapters (a load, u unload the selected one)", id="adapters-title")
                yield DataTable(id="adapter-table", cursor_type="row")
                yield Static(id="jobs")
        yield Input(id="prompt", classes="hidden", disabled=True)  # disabled while hidden: never takes focus or keys
        yield Footer(show_command_palette=False)  # its room goes to the screen's own keys

    def on_mount(self) -> None:
        self._log_to_textual()
        self.query_one("#cache-buckets", DataTable).add_columns(*views.CACHE_COLUMNS)
        self.query_one("#cache-entries", DataTable).add_columns("id", "state", "hits", "question")
        self.query_one("#trace-table", DataTable).add_columns("trace", "call", "tenant", "model", "cache", "time", "status")
        self.query_one("#key-table", DataTable).add_columns("id", "tenant", "app", "user", "role", "admin", "state")
        self.query_one("#model-table", DataTable).add_columns(*views.MODEL_COLUMNS)
        self.query_one("#adapter-table", DataTable).add_columns("model", "adapter", "scale", "requests", "path")
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
            sample = views.parse_metrics(text, time.monotonic())
            previous = self.samples[-1] if self.samples else None
            self.samples = (self.samples + [sample])[-120:]
            shown = views.overview(sample, previous, budgets)
            self.rates = (self.rates + [shown.tokens_per_s])[-60:]
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
        self.fleet, self.entries = [], []
        self.query_one("#budget-tree", Tree).clear()
        for shown in ("#overview-body", "#cache-summary", "#trace-timeline", "#memory", "#slots", "#jobs"):
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

    def _render_overview(self, o: views.Overview) -> None:
        ms = lambda s: "–" if s is None else f"{s * 1000:.0f} ms"  # noqa: E731
        pct = lambda v: "–" if v is None else f"{v:.0%}"  # noqa: E731
        lines = [
            f"requests/s {o.requests_per_s:6.2f}   tokens/s {o.tokens_per_s:7.1f}   errors/s {o.errors_per_s:5.2f}",
            f"tokens/s   {views.sparkline(self.rates, 50)}",
            f"TTFT p50 {ms(o.ttft_p50_s)}   p95 {ms(o.ttft_p95_s)}",
            "",
            "model                     slots  queue",
            *[f"{m:<24} {busy:>6} {queue:>6}" for m, busy, queue in o.models],
            "",
            f"cache hit rate {pct(o.hit_rate)}   cost-weighted verified hit rate {pct(o.verified_cost_hit_rate)}",
        ]
        if o.global_limit_usd is not None:
            lines.append(f"spend {views.usd(o.spend_today_usd or 0)} of the global {views.usd(o.global_limit_usd)} per {o.global_period}")
        else:
            lines.append(f"spend today {views.usd(o.spend_today_usd or 0)} (no global budget)")
        self.query_one("#overview-body", Static).update("\n".join(lines))

    def _render_budgets(self, budgets: dict[str, Any]) -> None:
        tree = self.query_one("#budget-tree", Tree)
        root = views.budget_tree(budgets)
        tree.clear()
        tree.root.set_label(f"{root.label}: {root.detail}")

        def add(parent: Any, node: views.BudgetNode) -> None:
            branch = parent.add(f"{node.label}: {node.detail}", expand=True) if node.children else parent.add_leaf(f"{node.label}: {node.detail}")
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

    def _render_traces(self, traces: dict[str, Any]) -> None:
        _fill(self.query_one("#trace-table", DataTable), views.trace_rows(traces, self.trace_filter, self.trace_text))

    def _render_keys(self, keys: dict[str, Any]) -> None:
        self.own_key = keys.get("caller")
        _fill(self.query_one("#key-table", DataTable), views.key_rows(keys))

    def _render_models(self, models: dict[str, Any], loaded: dict[str, Any], jobs: dict[str, Any]) -> None:
        self.fleet = views.fleet_rows(models, loaded)
        _fill(self.query_one("#model-table", DataTable), [row.cells for row in self.fleet])
        self.query_one("#memory", Static).update(views.memory_line(loaded))
        self.query_one("#slots", Static).update("\n".join(views.slot_lines(models, loaded)))
        _fill(self.query_one("#adapter-table", DataTable), views.adapter_rows(models))
        lines = views.job_lines(jobs, 24)
        self.query_one("#jobs", Static).update("\n".join(["jobs (z quantize, p pull, T train, s stop)", *lines]) if lines
                                                else "no jobs (z quantize, p pull, T train)")

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

    def action_ask(self, what: str) -> None:
        prompt = self.query_one("#prompt", Input)
        self.asking = what
        confirming = self.confirming
        prompt.placeholder = PROMPTS[what].format(word=confirming.word, detail=confirming.detail) if confirming else PROMPTS[what]
        prompt.value = ""
        prompt.disabled = False
        prompt.remove_class("hidden")
        prompt.focus()

    def action_cancel_prompt(self) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.add_class("hidden")
        prompt.disabled = True
        self.asking = self.confirming = None
        self._focus_tab()

    def action_cycle_filter(self) -> None:
        self.trace_filter = {"all": "error", "error": "ok", "ok": "all"}[self.trace_filter]
        self.notify(f"traces: {self.trace_filter}")
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
            elif what == "budget" and len(words) == 4:
                level, name, usd, period = words
                await self.client.set_budget(level, "*" if name == "-" else name, float(usd), period)
                self.notify(f"{level} {name}: {views.usd(float(usd))} per {period}")
            elif what == "traces":
                self.trace_text = " ".join(words)
                self.action_show("traces")
            elif what == "search" and words:
                found = await self.client.cache_entries(" ".join(words))
                self.entries = found["entries"]
                entries = self.query_one("#cache-entries", DataTable)
                _fill(entries, [(str(e["id"]), e["state"], str(e["hits"]), e["question"][:60]) for e in self.entries])
                self.action_show("cache")
                entries.focus()  # v and x act on the entry under the cursor
            elif what == "adapter" and len(words) in (3, 4):
                await self.client.load_adapter(words[0], words[1], words[2], float(words[3]) if len(words) == 4 else 1.0)
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
        except (AdminError, ValueError) as exc:
            self.notify(str(exc), severity="error")
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
            await self.client.mark_entry(entry_id, state)
            self.notify(f"entry {entry_id}: {state}")
        except AdminError as exc:
            self.notify(exc.message, severity="error")

    @on(DataTable.RowSelected, "#trace-table")
    async def open_trace(self, event: DataTable.RowSelected) -> None:
        trace_id = str(event.data_table.get_row_at(event.cursor_row)[0])
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


class SecretScreen(ModalScreen[None]):
    """A new key's secret, which the server shows only once: it stays up until dismissed, in
    plain text to select, and `c` puts it on the clipboard."""

    BINDINGS = [
        Binding("c", "copy", "Copy secret"),
        Binding("escape,enter", "dismiss", "Close"),
    ]

    def __init__(self, key_id: str, owner: str, secret: str) -> None:
        super().__init__()
        self.key_id, self.owner, self.secret = key_id, owner, secret

    def compose(self) -> ComposeResult:
        with Vertical(id="secret-dialog"):
            yield Static(f"[b]new key {self.key_id}[/b] for {self.owner}", id="secret-title")
            yield Static("The secret is shown only now: copy it before closing.")
            yield Static(self.secret, id="secret-text", markup=False)
            yield Static("c copy to the clipboard · enter or esc close", id="secret-help")
        yield Footer(show_command_palette=False)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.secret)
        self.notify("secret copied to the clipboard")


def _fill(table: DataTable, rows: list[tuple[str, ...]]) -> None:
    """Replace the rows, keeping the cursor where it was."""
    cursor = table.cursor_row
    table.clear()
    for row in rows:
        table.add_row(*row)
    if rows:
        table.move_cursor(row=min(cursor, len(rows) - 1))


def run(base_url: str, key: str | None) -> None:
    ApplianceTUI(base_url, key).run()
