"""Turning sampled token bytes into text safely: UTF-8 split across tokens, stop strings split
across tokens. Pure and engine-independent."""

from __future__ import annotations

import codecs


class Utf8Stream:
    """Decodes bytes as they arrive, holding an incomplete character until its last byte."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds the first stop string in streamed text.

    Text that could be the start of a stop string is held back until it is known not to be one,
    so a client never sees any part of a stop string.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit; sets `stopped` once a stop string is seen."""
        if self.stopped:
            return ""
        buffer = self._held + text
        if not self._stops:
            self._held = ""
            return buffer
        found = [(i, n, s) for n, s in enumerate(self._stops) if (i := buffer.find(s)) >= 0]
        if found:
            first, _, self.matched = min(found)  # the earliest; at one place, the first listed
            self.stopped = True
            self._held = ""
            return buffer[:first]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation, held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
