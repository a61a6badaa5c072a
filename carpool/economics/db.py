"""The economics database: one SQLite file holding API keys and the ledger.

WAL mode lets the reporting side (CLI, /v1/usage) read while the server's ledger writer appends, and lets
`carpool keys revoke` take effect on a running server at its next request.
"""

import os
import sqlite3
from pathlib import Path

from carpool.models.loader import cache_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key_id TEXT PRIMARY KEY,            -- public name of the key, shown in lists and the ledger
    key_hash TEXT NOT NULL UNIQUE,      -- sha256 of the secret; the secret itself is never stored
    tenant TEXT NOT NULL,
    is_admin INTEGER NOT NULL DEFAULT 0,
    allowed_tiers TEXT,                 -- comma-separated; NULL: every tier
    budget REAL,                        -- dollars per budget_period; NULL: no budget
    budget_period TEXT CHECK (budget_period IN ('day', 'month')),
    rpm INTEGER,                        -- requests per minute; NULL: unlimited
    tpm INTEGER,                        -- tokens per minute; NULL: unlimited
    created REAL NOT NULL,
    revoked REAL
);
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,                 -- unix seconds at which the request finished or was aborted
    request_id TEXT,
    key_id TEXT,                        -- NULL: the server was open (no keys configured)
    tenant TEXT,
    model TEXT NOT NULL,
    tier TEXT NOT NULL,
    uncached_prompt_tokens INTEGER NOT NULL,  -- prompt tokens computed fresh, cache writes included
    cache_read_tokens INTEGER NOT NULL,
    cache_write_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    queue_seconds REAL NOT NULL,
    prefill_seconds REAL NOT NULL,
    decode_seconds REAL NOT NULL,
    finish_reason TEXT NOT NULL,
    cost REAL NOT NULL                  -- dollars, priced when the row was written
);
CREATE INDEX IF NOT EXISTS ledger_time ON ledger (time);
CREATE INDEX IF NOT EXISTS ledger_key_time ON ledger (key_id, time);
"""


def default_db_path() -> Path:
    """`CARPOOL_DB`, else carpool.db in carpool's cache folder (`CARPOOL_CACHE_DIR`, ~/.cache/carpool)."""
    override = os.environ.get("CARPOOL_DB")
    return Path(override) if override else cache_dir() / "carpool.db"


def connect(path: str | Path) -> sqlite3.Connection:
    """A connection with the schema in place. Waits up to 30 s for a lock rather than failing a write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(SCHEMA)
    return conn
