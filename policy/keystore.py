"""API keys and failed sign-in attempts in SQLite. Secrets never reach the database: only hashes."""

from __future__ import annotations

import apsw

from policy.identity import KeyRecord, new_secret, secret_hash
from policy.sqlite import immediate


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


_COLUMNS = "id, user, tenant, app, role, admin, created_at, expires_at, revoked_at"


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

    def revoke(self, key_id: str, now: float) -> bool:
        with immediate(self.db):
            self.db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now, key_id))
            return self.db.changes() > 0

    def all(self) -> list[KeyRecord]:
        return [_record(row) for row in self.db.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at")]

    def record_failure(self, *, at: float, reason: str, key_id: str | None, fingerprint: str | None, client: str | None, path: str | None) -> None:
        with immediate(self.db):
            self.db.execute(
                "INSERT INTO auth_failures(at, reason, key_id, fingerprint, client, path) VALUES (?,?,?,?,?,?)",
                (at, reason, key_id, fingerprint, client, path),
            )

    def prune_failures(self, before: float) -> int:
        with immediate(self.db):
            self.db.execute("DELETE FROM auth_failures WHERE at < ?", (before,))
            return self.db.changes()

    def failures(self, limit: int = 100) -> list[dict[str, object]]:
        names = ("at", "reason", "key_id", "fingerprint", "client", "path")
        rows = self.db.execute(f"SELECT {', '.join(names)} FROM auth_failures ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(zip(names, row)) for row in rows]
