"""How the server's log lines are written: "text" for a person (the CLI's own format), "json" for a
log shipper: one JSON object a line with `ts`, `level`, `logger`, `message`, and a record's
`fields` (the access log's) as keys of their own. uvicorn's loggers are set to carry no handlers of
their own, so every line, theirs included, comes out in the one format."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import msgspec

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update((k, v) for k, v in fields.items() if k not in ("ts", "level", "logger", "message"))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(out).decode()


def use_format(log_format: str) -> None:
    """Every handler of the root logger writes `log_format`; uvicorn's lines go through the root's."""
    formatter: logging.Formatter = JsonLines() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO)
    for handler in root.handlers:
        handler.setFormatter(formatter)
    for name in _UVICORN:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
