"""Write transactions for the policy stores."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import apsw


@contextmanager
def immediate(db: apsw.Connection) -> Iterator[None]:
    """`BEGIN IMMEDIATE` … `COMMIT`, or `ROLLBACK` on an exception. The write lock is taken before
    anything is read: a deferred transaction that reads, then writes, fails at once with
    SQLITE_BUSY when another connection wrote in between (no busy wait can save it), and two
    readers could both act on the same stale row."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
