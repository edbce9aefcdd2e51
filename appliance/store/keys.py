"""API keys and failed sign-in attempts in SQLite. Secrets never reach the database: only hashes.

Failed sign-ins are counted, not listed: one row per minute, reason, key, client and path, with how
many there were and the first attempt's fingerprint, so a flood of wrong keys from one client is a
row a minute, and the table keeps at most a fixed number of rows whatever the clients do."""

from __future__ import annotations

from dataclasses import dataclass, field

import apsw

from policy.identity import KeyRecord, leaves_no_admin, new_secret, secret_hash
from appliance.store.transactions import immediate


def create_tables(db: apsw.Connection) -> None:
    db.execute(
        """
        CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            secret_sha256 TEXT NOT NULL UNIQUE,
            user TEXT NOT NULL,
            tenant TEXT NOT NULL,
            app TEXT NOT NULL,
            role TEXT NOT NULL,
            admin INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            expires_at REAL,
            revoked_at REAL
        ) STRICT;
        CREATE TABLE auth_failures (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            reason TEXT NOT NULL,
            key_id TEXT,
            fingerprint TEXT,
            client TEXT,
            path TEXT
        ) STRICT;
        CREATE INDEX auth_failures_at ON auth_failures(at);
        """
    )


def count_failures(db: apsw.Connection) -> None:
    db.execute("ALTER TABLE auth_failures ADD COLUMN count INTEGER NOT NULL DEFAULT 1")
    db.execute("ALTER TABLE auth_failures ADD COLUMN last_at REAL")
    db.execute("UPDATE auth_failures SET last_at = at")


_COLUMNS = "id, user, tenant, app, role, admin, created_at, expires_at, revoked_at"
OTHER_CLIENTS = "(other clients)"  # where a tally that is full counts the failures of sources it has no room for


@dataclass(frozen=True)
class FailureBucket:
    """The failed sign-ins one row counts."""

    minute: int  # unix time // 60
    reason: str
    key_id: str | None
    client: str | None
    path: str | None


@dataclass
class FailureCount:
    first_at: float
    last_at: float
    fingerprint: str | None  # the first attempt's
    count: int = 1


@dataclass
class FailureTally:
    """Failed sign-ins counted in memory until they are written together: a flood costs one write
    per flush, not one per attempt. At most `room` buckets; beyond, a minute's failures of every
    other source share one bucket (so a spray of clients or paths cannot grow it)."""

    room: int
    counts: dict[FailureBucket, FailureCount] = field(default_factory=dict)

    def add(self, at: float, reason: str, key_id: str | None, fingerprint: str | None, client: str | None, path: str | None) -> None:
        bucket = FailureBucket(int(at // 60), reason, key_id, client, path)
        if bucket not in self.counts and len(self.counts) >= self.room:
            bucket = FailureBucket(bucket.minute, reason, None, OTHER_CLIENTS, None)
        found = self.counts.get(bucket)
        if found is None:
            self.counts[bucket] = FailureCount(at, at, fingerprint)
        else:
            found.count += 1
            found.last_at = max(found.last_at, at)

    def take(self) -> dict[FailureBucket, FailureCount]:
        counts, self.counts = self.counts, {}
        return counts


def _record(row: tuple) -> KeyRecord:
    kid, user, tenant, app, role, admin, created, expires, revoked = row
    return KeyRecord(kid, user, tenant, app, role, bool(admin), created, expires, revoked)


class KeyStore:
    def __init__(self, db: apsw.Connection) -> None:
        self.db = db

    def create(self, *, user: str, tenant: str, app: str, role: str, admin: bool, now: float, expires_at: float | None) -> tuple[KeyRecord, str]:
        for name, value in (("user", user), ("tenant", tenant), ("app", app), ("role", role)):
            if not value or not value.strip():
                raise ValueError(f"{name} must not be empty")
        if expires_at is not None and expires_at <= now:
            raise ValueError("the expiry is in the past")
        key_id, secret = new_secret()
        with immediate(self.db):
            self.db.execute(
                "INSERT INTO api_keys(id, secret_sha256, user, tenant, app, role, admin, created_at, expires_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (key_id, secret_hash(secret), user, tenant, app, role, int(admin), now, expires_at),
            )
        return KeyRecord(key_id, user, tenant, app, role, admin, now, expires_at, None), secret

    def by_secret(self, secret: str) -> KeyRecord | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE secret_sha256 = ?", (secret_hash(secret),)).fetchone()
        return _record(row) if row else None

    def get(self, key_id: str) -> KeyRecord | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return _record(row) if row else None

    def revoke(self, key_id: str, now: float, *, keep_an_admin: bool = True) -> bool:
        """False if there is no such unrevoked key. With `keep_an_admin` (the admin API), the last
        active admin key is refused (LastAdminKey): only the CLI, on the machine, may revoke it."""
        with immediate(self.db):
            if keep_an_admin and (record := self.get(key_id)) is not None:
                admins = [_record(row) for row in self.db.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE admin = 1")]
                if leaves_no_admin(record, admins, now):
                    raise LastAdminKey(key_id)
            self.db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now, key_id))
            return self.db.changes() > 0

    def all(self) -> list[KeyRecord]:
        return [_record(row) for row in self.db.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at")]

    def record_failures(self, counts: dict[FailureBucket, FailureCount], keep: int) -> None:
        """Adds a tally to its minute's rows (one per bucket), then drops the oldest rows beyond `keep`."""
        with immediate(self.db):
            for b, c in counts.items():
                self.db.execute(
                    "UPDATE auth_failures SET count = count + ?, last_at = max(last_at, ?) WHERE at >= ? AND at < ? "
                    "AND reason = ? AND key_id IS ? AND client IS ? AND path IS ?",
                    (c.count, c.last_at, b.minute * 60, b.minute * 60 + 60, b.reason, b.key_id, b.client, b.path))
                if not self.db.changes():
                    self.db.execute(
                        "INSERT INTO auth_failures(at, reason, key_id, fingerprint, client, path, count, last_at) VALUES (?,?,?,?,?,?,?,?)",
                        (c.first_at, b.reason, b.key_id, c.fingerprint, b.client, b.path, c.count, c.last_at))
            # Ids grow with each row and only the oldest are deleted, so this keeps the newest `keep`.
            self.db.execute("DELETE FROM auth_failures WHERE id <= (SELECT max(id) FROM auth_failures) - ?", (keep,))

    def prune_failures(self, before: float) -> int:
        with immediate(self.db):
            self.db.execute("DELETE FROM auth_failures WHERE at < ?", (before,))
            return self.db.changes()

    def failures(self, limit: int = 100) -> list[dict[str, object]]:
        names = ("at", "last_at", "count", "reason", "key_id", "fingerprint", "client", "path")
        rows = self.db.execute(f"SELECT {', '.join(names)} FROM auth_failures ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(zip(names, row)) for row in rows]


class LastAdminKey(Exception):
    def __init__(self, key_id: str) -> None:
        super().__init__(f"{key_id} is the last active admin key: revoked, it would leave no key that can use /admin/*. "
                         f"Create another admin key first, or revoke it on the server with `appliance keys revoke {key_id}`.")
        self.key_id = key_id
