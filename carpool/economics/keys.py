"""API keys: who a secret belongs to, what it may use, and how much.

Secrets are 256-bit random strings, so a plain sha256 is enough to store them safely (nothing to brute-force);
the secret is shown once, when created, and only its hash is kept.
"""

import hashlib
import secrets
import sqlite3
import time
from dataclasses import dataclass

from carpool.economics.contract import BATCHES_READ_ALL, SCOPES, USAGE_READ
from carpool.engine.tiers import TIER_NAMES

SECRET_PREFIX = "sk-cp-"
BUDGET_PERIODS = ("day", "month")
ANONYMOUS = "anonymous"  # who made a request while the server was open (no keys configured), in reports and metrics
# What `--admin` grants, and what an admin key made before scopes existed (is_admin set, scopes NULL) holds: the
# usage reports and dashboard it had, and every tenant's batch objects, but not their files: reading another
# tenant's prompts (files:read-all) is granted only by name.
ADMIN_SCOPES = frozenset({USAGE_READ, BATCHES_READ_ALL})


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str
    scopes: frozenset[str]  # of carpool.economics.contract.SCOPES
    allowed_tiers: frozenset[str] | None  # None: every tier
    budget: float | None  # dollars per budget_period
    budget_period: str | None
    rpm: int | None
    tpm: int | None
    created: float
    revoked: float | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> "ApiKey":
        tiers, scopes = row["allowed_tiers"], row["scopes"]
        if scopes is None:  # a key made before scopes existed
            granted = ADMIN_SCOPES if row["is_admin"] else frozenset()
        else:
            granted = frozenset(scope for scope in scopes.split(",") if scope)
        return cls(
            key_id=row["key_id"],
            tenant=row["tenant"],
            scopes=granted,
            allowed_tiers=frozenset(tiers.split(",")) if tiers is not None else None,
            budget=row["budget"],
            budget_period=row["budget_period"],
            rpm=row["rpm"],
            tpm=row["tpm"],
            created=row["created"],
            revoked=row["revoked"],
        )


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(
    conn: sqlite3.Connection,
    tenant: str,
    *,
    scopes: list[str] | frozenset[str] = (),
    allowed_tiers: list[str] | None = None,
    budget: float | None = None,
    budget_period: str | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
) -> tuple[ApiKey, str]:
    """The new key and its secret (the only time the secret exists outside the caller's hands)."""
    if not tenant:
        raise ValueError("tenant must not be empty")
    tiers = _check_tiers(allowed_tiers)
    granted = _check_scopes(scopes)
    _check_budget(budget, budget_period)
    for name, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    key_id = "key_" + secrets.token_hex(6)
    with conn:
        conn.execute(
            "INSERT INTO keys (key_id, key_hash, tenant, is_admin, allowed_tiers, budget, budget_period, rpm, tpm,"
            " created, scopes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key_id,
                hash_secret(secret),
                tenant,
                int(bool(granted)),  # for readers of the table that predate scopes
                tiers,
                budget,
                budget_period,
                rpm,
                tpm,
                time.time(),
                granted,
            ),
        )
    return get_key(conn, key_id), secret


def get_key(conn: sqlite3.Connection, key_id: str) -> ApiKey:
    key = lookup_key(conn, key_id)
    if key is None:
        raise ValueError(f"no key with id {key_id!r}")
    return key


def lookup_key(conn: sqlite3.Connection, key_id: str) -> ApiKey | None:
    row = conn.execute("SELECT * FROM keys WHERE key_id = ?", (key_id,)).fetchone()
    return ApiKey.from_row(row) if row is not None else None


def find_key(conn: sqlite3.Connection, secret: str) -> ApiKey | None:
    row = conn.execute("SELECT * FROM keys WHERE key_hash = ?", (hash_secret(secret),)).fetchone()
    return ApiKey.from_row(row) if row is not None else None


def has_keys(conn: sqlite3.Connection) -> bool:
    """Whether any key was ever created: revoking every key must not reopen the server to everyone."""
    return conn.execute("SELECT 1 FROM keys LIMIT 1").fetchone() is not None


def list_keys(conn: sqlite3.Connection) -> list[ApiKey]:
    return [ApiKey.from_row(row) for row in conn.execute("SELECT * FROM keys ORDER BY created, key_id")]


def revoke_key(conn: sqlite3.Connection, key_id: str) -> ApiKey:
    get_key(conn, key_id)
    with conn:
        conn.execute("UPDATE keys SET revoked = ? WHERE key_id = ? AND revoked IS NULL", (time.time(), key_id))
    return get_key(conn, key_id)


def set_budget(conn: sqlite3.Connection, key_id: str, budget: float | None, budget_period: str | None) -> ApiKey:
    """Set (or, with budget None, clear) a key's budget."""
    get_key(conn, key_id)
    _check_budget(budget, budget_period)
    with conn:
        conn.execute("UPDATE keys SET budget = ?, budget_period = ? WHERE key_id = ?", (budget, budget_period, key_id))
    return get_key(conn, key_id)


def _check_tiers(tiers: list[str] | None) -> str | None:
    if tiers is None:
        return None
    unknown = sorted(set(tiers) - set(TIER_NAMES))
    if unknown or not tiers:
        raise ValueError(
            f"tiers must be a non-empty subset of {', '.join(TIER_NAMES)}; got {', '.join(tiers) or 'none'}"
        )
    return ",".join(t for t in TIER_NAMES if t in tiers)


def _check_scopes(scopes) -> str:
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise ValueError(f"scope {unknown[0]!r} is not one of {', '.join(SCOPES)}")
    return ",".join(scope for scope in SCOPES if scope in scopes)


def _check_budget(budget: float | None, period: str | None) -> None:
    if budget is None:
        if period is not None:
            raise ValueError("a budget period needs a budget amount")
        return
    if budget < 0:
        raise ValueError(f"budget must not be negative, got {budget}")
    if period not in BUDGET_PERIODS:
        raise ValueError(f"budget period must be one of {', '.join(BUDGET_PERIODS)}, got {period!r}")
