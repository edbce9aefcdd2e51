"""Setting values with a form of their own in models.toml: a keep-alive duration and a memory budget.

Each keeps the text the operator wrote (written back as is) beside the typed value the code uses.
`from_toml` raises ValueError with the problem; the settings reader adds the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?[hms])+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)([hms])")
_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0}
# Longer waits are "until the server stops" (-1); a bigger number overflows the timers that sleep on it.
MAX_KEEP_ALIVE_S = 365 * 86400.0


@dataclass(frozen=True)
class KeepAlive:
    """How long an idle model stays loaded."""

    seconds: float | None  # None: until the server stops
    text: str | int  # as written

    FORM: ClassVar[str] = 'a duration up to a year ("30s", "5m", "1h", "1h30m"), 0 to unload at once, or -1 to keep loaded'

    @classmethod
    def from_toml(cls, value: object) -> KeepAlive:
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, -1):
            return cls(None if value == -1 else 0.0, value)
        if isinstance(value, str) and _DURATION.match(value):
            seconds = sum(float(n) * _SECONDS[unit] for n, unit in _PART.findall(value))
            if seconds <= MAX_KEEP_ALIVE_S:
                return cls(seconds, value)
        raise ValueError(f"expected {cls.FORM}, got {value!r}")

    def to_toml(self) -> str | int:
        return self.text


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)$", re.IGNORECASE)
_SHARE = re.compile(r"^(\d+(?:\.\d+)?)\s*%$")
# No machine this serves holds more; a longer number would overflow the arithmetic on it.
MAX_MEMORY_BYTES = 1 << 50
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class MemoryBudget:
    """The memory loaded models may hold together: a size, or a share of the machine's RAM."""

    size_bytes: int | None  # a fixed size ...
    share: float | None  # ... or a fraction of RAM in (0, 1]
    text: str  # as written

    FORM: ClassVar[str] = 'a size up to 1PiB ("16GiB", "512MiB", "8GB") or a share of RAM ("80%")'

    @classmethod
    def from_toml(cls, value: object) -> MemoryBudget:
        if isinstance(value, str):
            if size := _SIZE.match(value.strip()):
                total = float(size[1]) * _UNITS[size[2].lower()]
                if 0 < total <= MAX_MEMORY_BYTES:
                    return cls(int(total), None, value)
            elif share := _SHARE.match(value.strip()):
                percent = float(share[1])
                if 0 < percent <= 100:
                    return cls(None, percent / 100, value)
        raise ValueError(f"expected {cls.FORM}, got {value!r}")

    def to_toml(self) -> str:
        return self.text

    def bytes_of(self, total_ram: int) -> int:
        """The budget on a machine with `total_ram` bytes of memory."""
        return self.size_bytes if self.size_bytes is not None else int(total_ram * (self.share or 0.0))
