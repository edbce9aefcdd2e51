"""Who is calling: API keys and the principal they stand for.

A key's secret is shown once and stored only as its SHA-256: secrets are 256 random bits, so a
fast hash is enough (no dictionary to slow down), and lookup by hash needs no per-key salt.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

SECRET_PREFIX = "apl-"


@dataclass(frozen=True)
class Principal:
    user: str
    tenant: str
    app: str
    role: str
    key_id: str | None = None  # None in open local-development mode
    admin: bool = False


@dataclass(frozen=True)
class KeyRecord:
    id: str
    user: str
    tenant: str
    app: str
    role: str
    admin: bool
    created_at: float
    expires_at: float | None
    revoked_at: float | None


@dataclass(frozen=True)
class AuthFailure:
    reason: str  # missing, malformed, unknown, revoked, expired
    message: str


def new_secret() -> tuple[str, str]:
    """(key id, secret). The id is public (logs, admin lists); the secret is shown once."""
    return f"key_{secrets.token_hex(6)}", SECRET_PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def fingerprint(presented: str) -> str:
    """What a log may say about a presented secret: a short hash, never the secret itself."""
    return secret_hash(presented)[:12]


def bearer_token(authorization: str | None) -> str | AuthFailure:
    if not authorization:
        return AuthFailure("missing", "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return AuthFailure("malformed", "The Authorization header must be 'Bearer <key>'.")
    return token


def check_key(record: KeyRecord | None, now: float) -> Principal | AuthFailure:
    """Pure: the principal a stored key stands for at `now`, or why it is refused."""
    if record is None:
        return AuthFailure("unknown", "Incorrect API key provided.")
    if record.revoked_at is not None and record.revoked_at <= now:
        return AuthFailure("revoked", f"The API key {record.id} has been revoked.")
    if record.expires_at is not None and record.expires_at <= now:
        return AuthFailure("expired", f"The API key {record.id} has expired.")
    return Principal(record.user, record.tenant, record.app, record.role, record.id, record.admin)


def leaves_no_admin(target: KeyRecord, keys: list[KeyRecord], now: float) -> bool:
    """Pure: revoking `target` would leave no key that `/admin/*` accepts, so nobody could use the
    admin API (or the TUI) again until someone on the machine makes one with the CLI."""
    active = [k.id for k in keys if k.admin and isinstance(check_key(k, now), Principal)]
    return active == [target.id]
