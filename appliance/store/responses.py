"""Stored responses (`store: true`), each under its tenant: another tenant never reads, continues
or deletes it (it is as absent). A row keeps the response object as it was returned and the
conversation it ends, so `previous_response_id` continues from it without walking a chain."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import apsw


def create_tables(db: apsw.Connection) -> None:
    db.execute(
        """
        CREATE TABLE responses (
            tenant TEXT NOT NULL,
            id TEXT NOT NULL,
            created_at REAL NOT NULL,
            response TEXT NOT NULL,
            conversation TEXT NOT NULL,
            PRIMARY KEY (tenant, id)
        ) STRICT;
        CREATE INDEX responses_created ON responses(created_at);
        """
    )


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: the earlier turns, this input, the answer


def save(db: apsw.Connection, tenant: str, response: dict[str, Any], conversation: list[dict[str, Any]], kept_s: float) -> None:
    """Stores a response, and deletes those older than `kept_s` (an index range: cheap when there are none)."""
    now = time.time()
    with db:
        db.execute("INSERT OR REPLACE INTO responses(tenant, id, created_at, response, conversation) VALUES (?, ?, ?, ?, ?)",
                   (tenant, response["id"], now, json.dumps(response), json.dumps(conversation)))
        db.execute("DELETE FROM responses WHERE created_at < ?", (now - kept_s,))


def load(db: apsw.Connection, tenant: str, response_id: str, kept_s: float) -> Stored | None:
    """A stored response of this tenant's, unless it is older than `kept_s` (gone, even before a save deletes it)."""
    row = db.execute("SELECT response, conversation FROM responses WHERE tenant = ? AND id = ? AND created_at >= ?",
                     (tenant, response_id, time.time() - kept_s)).fetchone()
    return Stored(json.loads(row[0]), json.loads(row[1])) if row else None


def delete(db: apsw.Connection, tenant: str, response_id: str) -> bool:
    with db:
        db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
        return db.changes() > 0
