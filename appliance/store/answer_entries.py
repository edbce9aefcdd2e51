"""The semantic cache's entries in SQLite, their vectors in a sqlite-vec `vec0` table partitioned
by bucket (a nearest-neighbour search never leaves its bucket), and the hits and feedback behind
the cache's measures."""

from __future__ import annotations

import re
from dataclasses import dataclass

import apsw
import numpy as np

from policy.answer_cache import STATES, Bucket, Candidate
from appliance.store.transactions import immediate


# The states migration 0005 allowed; 0014 added "consistent" (a sweep's agreement, which verifies nothing).
_STATES_0005 = ("unverified", "verified", "rejected", "stale")


def allow_consistent(db: apsw.Connection) -> None:
    """Migration 0014: the entries table again, its state check allowing "consistent"; rows, ids (the
    vectors' keys) and indexes as they were."""
    db.execute(_entries_table("cache_entries_next", STATES))
    db.execute("INSERT INTO cache_entries_next SELECT * FROM cache_entries")
    db.execute("DROP TABLE cache_entries")
    db.execute("ALTER TABLE cache_entries_next RENAME TO cache_entries")
    db.execute("CREATE INDEX cache_entries_tenant_used ON cache_entries(tenant, last_used_at)")
    db.execute("CREATE INDEX cache_entries_response ON cache_entries(response_id)")


def score_hits(db: apsw.Connection) -> None:
    """Migration 0015: a similar hit keeps the score its error bound admitted and the language it was
    asked in, so a caller's report of a false hit becomes a known trap of that language."""
    db.execute("ALTER TABLE cache_hits ADD COLUMN score REAL")
    db.execute("ALTER TABLE cache_hits ADD COLUMN language TEXT")


def labelled_traps_table(db: apsw.Connection) -> None:
    """Migration 0017: near misses an operator labelled (pairs needing different answers), for
    everyone (tenant '') or one tenant: more known traps for the error bound, in the team's language."""
    db.execute("""
        CREATE TABLE cache_traps (
            id INTEGER PRIMARY KEY,
            tenant TEXT NOT NULL,
            cached TEXT NOT NULL,
            asked TEXT NOT NULL,
            added_at REAL NOT NULL,
            UNIQUE (tenant, cached, asked)
        ) STRICT""")


def trap_cosines_table(db: apsw.Connection) -> None:
    """Migration 0018: a labelled trap's cosine under each embedder that scored it, so a start does
    not embed every labelled pair again (20,000 took about a minute on two cores)."""
    db.execute("""
        CREATE TABLE cache_trap_cosines (
            trap_id INTEGER NOT NULL REFERENCES cache_traps(id) ON DELETE CASCADE,
            embedder TEXT NOT NULL,
            cosine REAL NOT NULL,
            PRIMARY KEY (trap_id, embedder)
        ) STRICT""")


def judgements_table(db: apsw.Connection) -> None:
    """Migration 0019: the cache's judge's P(same answer) on each known trap, by judge model (a start
    asks only about pairs it has not answered), and on each hit it admitted, so a report of that
    hit as wrong tightens the judge's cut."""
    db.execute("""
        CREATE TABLE cache_judgements (
            judge TEXT NOT NULL,
            pair TEXT NOT NULL,
            probability REAL NOT NULL,
            PRIMARY KEY (judge, pair)
        ) STRICT""")
    db.execute("ALTER TABLE cache_hits ADD COLUMN judge REAL")


# More than any language's bound needs (299 traps for 1%); each is scored once per embedder.
MAX_LABELLED_TRAPS = 20_000


class TrapsFull(Exception):
    def __init__(self, stored: int) -> None:
        super().__init__(f"the cache holds at most {MAX_LABELLED_TRAPS:,} labelled traps; {stored:,} are stored")
        self.stored = stored


@dataclass(frozen=True)
class LabelledTrap:
    tenant: str  # "" for everyone
    cached: str
    asked: str
    id: int | None = None  # once stored


@dataclass(frozen=True)
class Reported:
    tenant: str
    language: str
    score: float
    judge: float | None = None  # the judge's P(same answer), where the judge admitted the hit


def _entries_table(name: str, states: tuple[str, ...]) -> str:
    return f"""
        CREATE TABLE {name} (
            id INTEGER PRIMARY KEY,
            bucket TEXT NOT NULL,
            tenant TEXT NOT NULL,
            role TEXT NOT NULL,
            model TEXT NOT NULL,
            model_version TEXT NOT NULL,
            prompt_version TEXT NOT NULL,
            question TEXT NOT NULL,
            question_hash TEXT NOT NULL,
            answer TEXT NOT NULL,
            finish_reason TEXT NOT NULL,
            prompt_text TEXT NOT NULL,  -- the whole prompt as the model saw it: what a sweep re-asks
            max_tokens INTEGER NOT NULL,
            stop TEXT NOT NULL,  -- JSON list
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            cost_nanos INTEGER NOT NULL,
            state TEXT NOT NULL CHECK (state IN ({", ".join(f"'{s}'" for s in states)})),
            state_reason TEXT,
            response_id TEXT NOT NULL,
            embedder TEXT,
            created_at REAL NOT NULL,
            last_used_at REAL NOT NULL,
            hits INTEGER NOT NULL DEFAULT 0,
            UNIQUE (bucket, question_hash)
        ) STRICT;"""


def create_tables(db: apsw.Connection) -> None:
    db.execute(
        f"""
        {_entries_table("cache_entries", _STATES_0005).strip()}
        CREATE INDEX cache_entries_tenant_used ON cache_entries(tenant, last_used_at);
        CREATE INDEX cache_entries_response ON cache_entries(response_id);
        CREATE TABLE cache_hits (
            response_id TEXT PRIMARY KEY,
            entry_id INTEGER NOT NULL,
            tenant TEXT NOT NULL,
            at REAL NOT NULL,
            similarity REAL NOT NULL,
            judged INTEGER NOT NULL,
            entry_state TEXT NOT NULL,
            saved_nanos INTEGER NOT NULL
        ) STRICT;
        CREATE INDEX cache_hits_entry ON cache_hits(entry_id);
        CREATE TABLE cache_feedback (
            id INTEGER PRIMARY KEY,
            response_id TEXT NOT NULL,
            entry_id INTEGER NOT NULL,
            rating TEXT NOT NULL CHECK (rating IN ('good', 'bad')),
            was_hit INTEGER NOT NULL,
            at REAL NOT NULL
        ) STRICT;
        CREATE TABLE cache_sweeps (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            entry_id INTEGER NOT NULL,
            outcome TEXT NOT NULL,
            similarity REAL
        ) STRICT;
        """
    )


@dataclass(frozen=True)
class Entry:
    id: int
    bucket: str
    tenant: str
    role: str
    model: str
    question: str
    answer: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cost_nanos: int
    state: str
    response_id: str
    created_at: float
    hits: int
    prompt_text: str = ""
    max_tokens: int = 0
    stop: str = "[]"


_ENTRY = ("id, bucket, tenant, role, model, question, answer, finish_reason, prompt_tokens, completion_tokens, cost_nanos, "
          "state, response_id, created_at, hits, prompt_text, max_tokens, stop")


# vec0 allocates whole chunks per partition (bucket): at its default of 1,024 vectors a bucket holding one
# 384-dimension entry took 1.6 MB on disk, so a caller could fill the disk by varying its system prompt.
# At 64 a bucket costs about 100 KB, and a 10,000-entry bucket is still searched in milliseconds.
VECTOR_CHUNK = 64


def _vec_table(embedder: str) -> str:
    return "cache_vectors_" + re.sub(r"[^a-z0-9]+", "_", embedder.lower()).strip("_")


def _create_vectors(db: apsw.Connection, name: str, dimension: int) -> None:
    db.execute(
        f"CREATE VIRTUAL TABLE IF NOT EXISTS {name} USING vec0(entry_id INTEGER PRIMARY KEY, bucket TEXT PARTITION KEY, "
        f"embedding float[{dimension}] distance_metric=cosine, chunk_size={VECTOR_CHUNK})"
    )


def small_vector_chunks(db: apsw.Connection) -> None:
    """Migration 0016: every vector table again with small chunks (VECTOR_CHUNK), its vectors copied over."""
    tables = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name LIKE 'cache\\_vec\\_%' ESCAPE '\\' "
                        "AND sql LIKE 'CREATE VIRTUAL TABLE%'").fetchall()
    for name, sql in tables:
        dimension = int(re.search(r"float\[(\d+)\]", sql).group(1))  # type: ignore[union-attr]
        new = "cache_vectors_" + name.removeprefix("cache_vec_")
        _create_vectors(db, new, dimension)
        db.execute(f"INSERT INTO {new}(entry_id, bucket, embedding) SELECT entry_id, bucket, embedding FROM {name}")
        db.execute(f"DROP TABLE {name}")


class CacheStore:
    """One connection, used by one thread at a time. `embedder` names the vector space (model and
    dimension); each has its own vec0 table, made on first use."""

    def __init__(self, db: apsw.Connection, embedder: str, dimension: int) -> None:
        self.db, self.embedder, self.dimension = db, embedder, dimension
        self.vectors = _vec_table(f"{embedder}_{dimension}")
        _create_vectors(db, self.vectors, dimension)

    def exact(self, bucket: str, question_hash: str) -> Entry | None:
        row = self.db.execute(f"SELECT {_ENTRY} FROM cache_entries WHERE bucket = ? AND question_hash = ?", (bucket, question_hash)).fetchone()
        return Entry(*row) if row else None

    def nearest(self, bucket: str, vector: np.ndarray, k: int = 4) -> list[Candidate]:
        rows = self.db.execute(
            f"SELECT v.entry_id, v.distance, e.question, e.state, e.created_at, e.cost_nanos FROM {self.vectors} v "
            f"JOIN cache_entries e ON e.id = v.entry_id WHERE v.embedding MATCH ? AND k = ? AND v.bucket = ? ORDER BY v.distance",
            (vector.astype(np.float32).tobytes(), k, bucket),
        )
        return [Candidate(eid, question, 1.0 - dist, state, created, cost_nanos=cost) for eid, dist, question, state, created, cost in rows]

    def get(self, entry_id: int) -> Entry | None:
        row = self.db.execute(f"SELECT {_ENTRY} FROM cache_entries WHERE id = ?", (entry_id,)).fetchone()
        return Entry(*row) if row else None

    def store(
        self, bucket: Bucket, question: str, question_hash: str, vector: np.ndarray | None, answer: str, finish_reason: str,
        prompt_tokens: int, completion_tokens: int, cost_nanos: int, response_id: str, now: float, max_entries_per_tenant: int,
        prompt_text: str = "", max_tokens: int = 0, stop: str = "[]", verified_by: str | None = None,
    ) -> int | None:
        """Insert an entry (unverified, or verified when a validator of the caller's passed it: `verified_by`)
        unless the bucket already has this question: concurrent identical misses store one. Evicts the
        tenant's least recently used beyond the cap."""
        state, reason = ("verified", verified_by) if verified_by else ("unverified", None)
        with immediate(self.db):
            row = self.db.execute("SELECT id, state FROM cache_entries WHERE bucket = ? AND question_hash = ?",
                                  (bucket.key, question_hash)).fetchone()
            if row is not None:
                if row[1] != "stale":
                    return None  # one entry per question; a rejected one keeps its place, never served
                # A stale entry is replaced by the next miss's answer.
                self.db.execute(
                    "UPDATE cache_entries SET answer = ?, finish_reason = ?, prompt_tokens = ?, completion_tokens = ?, cost_nanos = ?, "
                    "state = ?, state_reason = ?, response_id = ?, created_at = ?, last_used_at = ?, "
                    "prompt_text = ?, max_tokens = ?, stop = ? WHERE id = ?",
                    (answer, finish_reason, prompt_tokens, completion_tokens, cost_nanos, state, reason or "replaced", response_id, now, now,
                     prompt_text, max_tokens, stop, row[0]),
                )
                return int(row[0])
            self.db.execute(
                "INSERT INTO cache_entries(bucket, tenant, role, model, model_version, prompt_version, question, question_hash, "
                "answer, finish_reason, prompt_tokens, completion_tokens, cost_nanos, state, response_id, embedder, created_at, "
                "last_used_at, prompt_text, max_tokens, stop, state_reason) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (bucket.key, bucket.tenant, bucket.role, bucket.model, bucket.model_version, bucket.prompt_version, question,
                 question_hash, answer, finish_reason, prompt_tokens, completion_tokens, cost_nanos, state, response_id,
                 self.embedder if vector is not None else None, now, now, prompt_text, max_tokens, stop, reason),
            )
            entry_id = self.db.last_insert_rowid()
            if vector is not None:
                self.db.execute(f"INSERT INTO {self.vectors}(entry_id, bucket, embedding) VALUES (?, ?, ?)",
                                (entry_id, bucket.key, vector.astype(np.float32).tobytes()))
            self._evict(bucket.tenant, max_entries_per_tenant)
            return entry_id

    def _evict(self, tenant: str, cap: int) -> None:
        over = [row[0] for row in self.db.execute(
            "SELECT id FROM cache_entries WHERE tenant = ? ORDER BY last_used_at DESC LIMIT -1 OFFSET ?", (tenant, cap))]
        self.delete(over)

    def delete(self, ids: list[int]) -> None:
        for entry_id in ids:
            self.db.execute("DELETE FROM cache_entries WHERE id = ?", (entry_id,))
            self.db.execute(f"DELETE FROM {self.vectors} WHERE entry_id = ?", (entry_id,))

    def record_hit(self, entry: Entry, response_id: str, similarity: float, judged: bool, now: float,
                   score: float | None = None, language: str | None = None, judge: float | None = None) -> None:
        with immediate(self.db):
            self.db.execute("UPDATE cache_entries SET hits = hits + 1, last_used_at = ? WHERE id = ?", (now, entry.id))
            self.db.execute(
                "INSERT OR IGNORE INTO cache_hits(response_id, entry_id, tenant, at, similarity, judged, entry_state, saved_nanos, "
                "score, language, judge) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (response_id, entry.id, entry.tenant, now, similarity, int(judged), entry.state, entry.cost_nanos, score, language, judge),
            )

    def reported(self) -> list[Reported]:
        """Every hit a caller reported wrong that an error bound had admitted: the known traps beyond the shipped ones."""
        rows = self.db.execute(
            "SELECT tenant, language, score, judge FROM cache_hits WHERE score IS NOT NULL AND language IS NOT NULL AND response_id IN "
            "(SELECT response_id FROM cache_feedback WHERE rating = 'bad' AND was_hit = 1) ORDER BY at")
        return [Reported(*row) for row in rows]

    def add_traps(self, traps: list[LabelledTrap], now: float) -> list[LabelledTrap]:
        """Store labelled near misses; returns those not already known (the same pair twice is one
        trap). Past MAX_LABELLED_TRAPS in all, none is stored: TrapsFull."""
        added = []
        with immediate(self.db):
            for t in traps:
                self.db.execute("INSERT OR IGNORE INTO cache_traps(tenant, cached, asked, added_at) VALUES (?, ?, ?, ?)",
                                (t.tenant, t.cached, t.asked, now))
                if self.db.changes():
                    added.append(LabelledTrap(t.tenant, t.cached, t.asked, self.db.last_insert_rowid()))
            stored = self.db.execute("SELECT count(*) FROM cache_traps").fetchone()[0]
            if stored > MAX_LABELLED_TRAPS:
                raise TrapsFull(stored - len(added))  # the transaction rolls back: nothing of this call stays
        return added

    def labelled_traps(self) -> list[LabelledTrap]:
        return [LabelledTrap(*row) for row in self.db.execute("SELECT tenant, cached, asked, id FROM cache_traps ORDER BY id")]

    def trap_cosines(self, embedder: str) -> dict[int, float]:
        return dict(self.db.execute("SELECT trap_id, cosine FROM cache_trap_cosines WHERE embedder = ?", (embedder,)))

    def keep_trap_cosines(self, embedder: str, cosines: dict[int, float]) -> None:
        with immediate(self.db):
            # A trap removed meanwhile has no row to point at: its cosine is not kept.
            self.db.executemany("INSERT OR REPLACE INTO cache_trap_cosines(trap_id, embedder, cosine) "
                                "SELECT id, ?, ? FROM cache_traps WHERE id = ?", [(embedder, c, i) for i, c in cosines.items()])

    def judgements(self, judge: str) -> dict[str, float]:
        return dict(self.db.execute("SELECT pair, probability FROM cache_judgements WHERE judge = ?", (judge,)))

    def keep_judgements(self, judge: str, answers: dict[str, float]) -> None:
        with immediate(self.db):
            self.db.executemany("INSERT OR REPLACE INTO cache_judgements(judge, pair, probability) VALUES (?, ?, ?)",
                                [(judge, pair, p) for pair, p in answers.items()])

    def newly_reported(self, response_id: str, tenant: str) -> Reported | None:
        """The hit behind a response, if a bound admitted it and this is its first report as wrong (a
        second report of the same hit is not a second trap)."""
        row = self.db.execute(
            "SELECT tenant, language, score, judge FROM cache_hits WHERE response_id = ? AND tenant = ? AND score IS NOT NULL "
            "AND language IS NOT NULL AND (SELECT count(*) FROM cache_feedback WHERE response_id = ? AND rating = 'bad') = 1",
            (response_id, tenant, response_id)).fetchone()
        return Reported(*row) if row else None

    def set_state(self, entry_id: int, state: str, reason: str) -> bool:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        with immediate(self.db):
            # A rejected entry stays rejected: nothing verifies it again.
            self.db.execute("UPDATE cache_entries SET state = ?, state_reason = ? WHERE id = ? AND state != 'rejected'", (state, reason, entry_id))
            return self.db.changes() > 0

    def feedback(self, response_id: str, rating: str, tenant: str, now: float) -> tuple[int, bool] | None:
        """Good verifies the entry behind a response, bad rejects it. Returns (entry id, was it a
        hit), or None when the response is not the caller's cached or stored answer."""
        hit = self.db.execute("SELECT entry_id FROM cache_hits WHERE response_id = ? AND tenant = ?", (response_id, tenant)).fetchone()
        if hit is not None:
            entry_id, was_hit = hit[0], True
        else:
            row = self.db.execute("SELECT id FROM cache_entries WHERE response_id = ? AND tenant = ?", (response_id, tenant)).fetchone()
            if row is None:
                return None
            entry_id, was_hit = row[0], False
        with immediate(self.db):
            self.db.execute("INSERT INTO cache_feedback(response_id, entry_id, rating, was_hit, at) VALUES (?,?,?,?,?)",
                            (response_id, entry_id, rating, int(was_hit), now))
        self.set_state(entry_id, "verified" if rating == "good" else "rejected", f"feedback:{rating}")
        return entry_id, was_hit

    def invalidate(self, *, bucket: str | None = None, tenant: str | None = None, prompt_version: str | None = None) -> int:
        clauses, params = [], []
        for column, value in (("bucket", bucket), ("tenant", tenant), ("prompt_version", prompt_version)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if not clauses:
            raise ValueError("say which entries to invalidate")
        with immediate(self.db):
            self.db.execute(f"UPDATE cache_entries SET state = 'stale', state_reason = 'invalidated' "
                            f"WHERE {' AND '.join(clauses)} AND state IN ('unverified', 'consistent', 'verified')", params)
            return self.db.changes()

    def search(self, text: str, tenant: str | None, limit: int = 50) -> list[Entry]:
        sql = f"SELECT {_ENTRY} FROM cache_entries WHERE (question LIKE ?1 OR answer LIKE ?1)"
        params: list[object] = [f"%{text}%"]
        if tenant is not None:
            sql += " AND tenant = ?2"
            params.append(tenant)
        return [Entry(*row) for row in self.db.execute(sql + " ORDER BY last_used_at DESC LIMIT " + str(int(limit)), params)]

    def stats(self) -> list[dict[str, object]]:
        rows = self.db.execute(
            "SELECT bucket, tenant, role, model, prompt_version, count(*), sum(hits), sum(state = 'verified'), sum(state = 'consistent'), "
            "sum(state = 'rejected'), sum(state = 'stale'), max(last_used_at) FROM cache_entries GROUP BY bucket ORDER BY sum(hits) DESC"
        )
        names = ("bucket", "tenant", "role", "model", "prompt_version", "entries", "hits", "verified", "consistent", "rejected", "stale",
                 "last_used_at")
        return [dict(zip(names, row)) for row in rows]

    def sweep_sample(self, limit: int, now: float, freshness_s: float) -> list[Entry]:
        """Entries worth re-asking, most valuable first (hits × cost), fresh and still served."""
        rows = self.db.execute(
            f"SELECT {_ENTRY} FROM cache_entries WHERE state IN ('unverified', 'consistent', 'verified') AND created_at >= ? "
            "ORDER BY (hits + 1) * (cost_nanos + 1) DESC, last_used_at DESC LIMIT ?",
            (now - freshness_s, limit),
        )
        return [Entry(*row) for row in rows]

    def record_sweep(self, entry_id: int, outcome: str, similarity: float | None, now: float) -> None:
        with immediate(self.db):
            self.db.execute("INSERT INTO cache_sweeps(at, entry_id, outcome, similarity) VALUES (?,?,?,?)", (now, entry_id, outcome, similarity))

    def expire(self, now: float, freshness_s: float, current_versions: dict[str, str]) -> int:
        """Retire entries past their freshness window, and those of a model version no longer served."""
        ids = [row[0] for row in self.db.execute("SELECT id FROM cache_entries WHERE created_at < ?", (now - freshness_s,))]
        for model, version in current_versions.items():
            ids += [row[0] for row in self.db.execute(
                "SELECT id FROM cache_entries WHERE model = ? AND model_version != ?", (model, version))]
        with immediate(self.db):
            self.delete(sorted(set(ids)))
        return len(set(ids))
