"""The `appliance` command's exit statuses, said once: what its commands return, what `main` turns
an error into, and what `appliance --help` lists."""

from __future__ import annotations

OK = 0
FAILED = 1  # the command ran and found something wrong
USAGE = 2  # argparse's own status for a bad command line; the same for a config or key file that cannot be used
NOT_PROMOTED = 3  # `distill evaluate --promote`: measured, and refused (docs/architecture.md says 3)
UNREACHABLE = 4  # no server answers at the URL
INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report a command that SIGINT ended

MEANINGS = (
    (OK, "done"),
    (FAILED, "failed: a check found a problem, the server or the data directory refused, no such key or model"),
    (USAGE, "usage: a bad option or argument, or a config or key file that cannot be used"),
    (NOT_PROMOTED, "distill evaluate --promote: the adapter was measured and not promoted"),
    (UNREACHABLE, "no server answers at the URL (--url, $APPLIANCE_URL, else the config's host and port)"),
    (INTERRUPTED, "interrupted (Ctrl-C)"),
)


class CommandError(Exception):
    """Ends a command: `main` prints `error: <message>` on stderr and exits with `status`."""

    def __init__(self, message: str, status: int = FAILED) -> None:
        super().__init__(message)
        self.status = status


def epilog() -> str:
    return "exit status:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in MEANINGS)
