"""The TUI's own widgets: the overview's charts and the dialog that shows a new key's secret."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Sparkline, Static

from tui.overview import CHARTS, Series


class Charts(Vertical):
    """The overview's sparklines, one a line: what it is, the last scrapes, the latest value."""

    def compose(self) -> ComposeResult:
        for key, label in CHARTS:
            with Horizontal(classes="chart"):
                yield Static(label, classes="chart-label")
                yield Sparkline([], id=f"chart-{key}")
                yield Static("–", id=f"chart-{key}-now", classes="chart-now")

    def show(self, series: Series) -> None:
        for key, values, now in series.charts():
            self.query_one(f"#chart-{key}", Sparkline).data = list(values)
            self.query_one(f"#chart-{key}-now", Static).update(now)


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
