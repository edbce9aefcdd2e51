"""Answers kept for distillation: each with the prompt that asked for it, the route and model that
produced it, the tenant, the request's task family, a validator it passed and the caller's
feedback. Only an opted-in tenant's answers are written (`[distill] tenants`), and only while it
is, so nothing is kept unless distillation is configured.

The semantic cache is not the source: it evicts and expires entries, never holds a request that
bypassed it (hot, `no-store`, n > 1, the cache off), and names a route, not the tier that
answered. Its verdicts still count: an export joins an answer's cache entry (by response id) for
feedback given through a hit and marks from the admin API."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import apsw

from policy.distill import Kept


def create_tables(db: apsw.Connection) -> None:
    db.execute(
        """
        CREATE TABLE kept_answers (
            tenant TEXT NOT NULL,
            response_id TEXT NOT NULL,
            created_at REAL NOT NULL,
            route TEXT,  -- the routed alias asked, NULL when the request named a model
            model TEXT NOT NULL,  -- the model (with its adapters, if any) that produced the answer
            family TEXT,  -- the request's metadata.family, when it gave one
            messages TEXT NOT NULL,  -- JSON: the chat turns as asked
            answer TEXT NOT NULL,
            finish_reason TEXT NOT NULL,
            validator TEXT,  -- a validator the answer passed on its way out (json_schema)
            rating TEXT CHECK (rating IN ('good', 'bad')),  -- the caller's feedback (POST /v1/cache/feedback)
            PRIMARY KEY (tenant, response_id)
        ) STRICT;
        CREATE INDEX kept_answers_created ON kept_answers(created_at);
        """
    )


@dataclass(frozen=True)
class Answer:
    """One answer to keep, as the request path hands it over."""

    tenant: str
    response_id: str
    route: str | None
    model: str
    family: str | None
    messages: Sequence[dict[str, str]]
    answer: str
    finish_reason: str
    validator: str | None


def keep(db: apsw.Connection, answer: Answer, retention_s: float, now: float | None = None) -> None:
    """Writes one answer and retires those past retention (an index range: cheap when there are none)."""
    now = time.time() if now is None else now
    a = answer
    with db:
        db.execute("INSERT OR REPLACE INTO kept_answers(tenant, response_id, created_at, route, model, family, messages, answer, "
                   "finish_reason, validator) VALUES (?,?,?,?,?,?,?,?,?,?)",
                   (a.tenant, a.response_id, now, a.route, a.model, a.family, json.dumps(list(a.messages)), a.answer,
                    a.finish_reason, a.validator))
        db.execute("DELETE FROM kept_answers WHERE created_at < ?", (now - retention_s,))


def rate(db: apsw.Connection, tenant: str, response_id: str, rating: str) -> bool:
    """The caller's feedback on one of its kept answers; False when none has this id."""
    with db:
        db.execute("UPDATE kept_answers SET rating = ? WHERE tenant = ? AND response_id = ?", (rating, tenant, response_id))
        return db.changes() > 0


def since(db: apsw.Connection, start: float) -> list[Kept]:
    """Every answer kept from `start` on, oldest first, with the cache's verdict on it where it has one."""
    rows = db.execute(
        "SELECT k.response_id, k.tenant, k.route, k.model, k.family, k.messages, k.answer, k.finish_reason, k.created_at, "
        "k.validator, k.rating, e.state, e.state_reason FROM kept_answers k "
        "LEFT JOIN cache_entries e ON e.response_id = k.response_id AND e.tenant = k.tenant "
        "WHERE k.created_at >= ? ORDER BY k.created_at, k.response_id", (start,))
    return [Kept(rid, tenant, route, model, family, tuple((m["role"], m["content"]) for m in json.loads(messages)), answer, finish,
                 created, validator, rating, state, reason)
            for rid, tenant, route, model, family, messages, answer, finish, created, validator, rating, state, reason in rows]
