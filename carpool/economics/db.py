"""The economics database: one SQLite file holding API keys and the ledger (or, for several replicas, a
PostgreSQL database: `--db postgresql://...`, carpool/postgres.py; SCHEMA below describes both).

WAL mode lets the reporting side (CLI, /v1/usage) read while the server's ledger writer appends, and lets
`carpool keys revoke` take effect on a running server at its next request. Any failure to open or check the file
is a DatabaseUnusable naming the path and the cause in one line.
"""

import os
import sqlite3
from pathlib import Path

from carpool import postgres
from carpool.models.loader import cache_dir
from carpool.postgres import is_postgres_url

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
    revoked REAL,
    scopes TEXT                         -- comma-separated (contract.SCOPES); NULL: made before scopes, by is_admin
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
    cost REAL NOT NULL,                 -- dollars, priced when the row was written
    -- Added by the second wave (see ADDED_COLUMNS): how a row relates to the request its client sent.
    purpose TEXT NOT NULL DEFAULT 'request',  -- 'request' | 'cascade_attempt' | 'compression'
    parent_request_id TEXT,             -- the client request this row is one part of; NULL: the request itself
    cascade TEXT,                       -- the cascade's name, on its attempts' rows
    cascade_step INTEGER,               -- 0-based step of the cascade this attempt ran
    cascade_accepted INTEGER,           -- 1: this attempt's answer went to the client
    constraint_kind TEXT,               -- structured output: json_schema | json_object | regex | choice | grammar | tools
    original_prompt_tokens INTEGER,     -- prompt tokens before prompt compression; NULL: not compressed
    -- Prompt tokens written under a cache breakpoint's TTL pin, by TTL (not in cache_write_tokens, which holds
    -- automatic writes; all three are part of uncached_prompt_tokens). Migration 005 on PostgreSQL.
    cache_write_5m_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_1h_tokens INTEGER NOT NULL DEFAULT 0,
    -- What a replay of the traffic needs (`carpool cost whatif`), and no text. Migration 007 on PostgreSQL.
    arrived REAL,                       -- unix seconds at which the request arrived; NULL: written before
    prompt_block_chain TEXT             -- its prompt's prefix-cache block hashes (economics.block_chain); NULL: before
);
CREATE INDEX IF NOT EXISTS ledger_time ON ledger (time);
CREATE INDEX IF NOT EXISTS ledger_key_time ON ledger (key_id, time);
-- A billed row's request_id is unique (carpool/economics/ledger.py): a second row under the id is written withheld.
CREATE UNIQUE INDEX IF NOT EXISTS ledger_request_id ON ledger (request_id) WHERE finish_reason <> 'withheld';
-- Every read of another tenant's data under a read-all scope (files:read-all: their prompts), written before the
-- reader gets it: who, what, when.
CREATE TABLE IF NOT EXISTS audit_log (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,                 -- unix seconds
    key_id TEXT,                        -- who read: the key (NULL: the server was open)
    tenant TEXT,
    action TEXT NOT NULL,               -- what: files.content
    target TEXT NOT NULL,               -- the object read (a file id)
    owner TEXT                          -- whose it is: the tenant (or key) that owns it
);
"""

# Columns a database written before they existed gets on open (SQLite's ADD COLUMN is instant: it rewrites no
# row), so an operator's ledger keeps its history across upgrades. Each is the same text as in SCHEMA.
ADDED_COLUMNS = {
    "keys": ["scopes TEXT"],
    "ledger": [
        "purpose TEXT NOT NULL DEFAULT 'request'",
        "parent_request_id TEXT",
        "cascade TEXT",
        "cascade_step INTEGER",
        "cascade_accepted INTEGER",
        "constraint_kind TEXT",
        "original_prompt_tokens INTEGER",
        "cache_write_5m_tokens INTEGER NOT NULL DEFAULT 0",
        "cache_write_1h_tokens INTEGER NOT NULL DEFAULT 0",
        "arrived REAL",
        "prompt_block_chain TEXT",
    ],
}


def default_db_path() -> str | Path:
    """`CARPOOL_DB` (a file or a postgresql:// URL), else carpool.db in carpool's cache folder (`CARPOOL_CACHE_DIR`,
    ~/.cache/carpool)."""
    override = os.environ.get("CARPOOL_DB")
    if is_postgres_url(override):
        return override
    return Path(override) if override else cache_dir() / "carpool.db"


def open_database(db: str | Path):
    """A connection to the SQLite file or PostgreSQL URL `db`, schema in place. Both speak sqlite3's interface
    (`?` parameters, rows by name, `with conn:` as a transaction), so the code above them is written once."""
    if is_postgres_url(db):
        try:
            return postgres.connect_postgres(db)
        except postgres.PostgresUnusable as error:
            raise DatabaseUnusable(str(error)) from None
    return connect(db)


def check_any_database(conn, db: str | Path) -> None:
    """check_database for either kind of database."""
    if is_postgres_url(db):
        check_postgres(conn)
    else:
        check_database(conn, db)


def check_postgres(conn: postgres.PostgresConnection) -> None:
    """check_database on PostgreSQL: every migration applied, the keys and ledger tables hold SCHEMA's columns
    (the one description both databases follow: the migrations give PostgreSQL's types), and it takes writes."""
    where = postgres.redacted(conn.url)
    try:
        newest = postgres.migrations()[-1][0]
        (version,) = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        if version != newest:
            raise DatabaseUnusable(f"{where}: schema version {version}, this carpool writes version {newest}")
        for table, columns in expected_columns().items():
            found = [
                row[0]
                for row in conn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
                    "AND table_name = ? ORDER BY ordinal_position",
                    (table,),
                )
            ]
            if found != columns:
                raise DatabaseUnusable(
                    f"{where}: table {table} is not the one carpool writes (columns {', '.join(found) or 'none'})"
                )
        postgres.check_writable(conn)
    except postgres.errors() as error:
        raise DatabaseUnusable(f"{where}: {postgres.cause(error)}") from None


def expected_columns() -> dict[str, list[str]]:
    """{table: column names in order} as SCHEMA has them: what either database's tables must hold."""
    expected = sqlite3.connect(":memory:")
    expected.executescript(SCHEMA)
    tables = [name for (name,) in expected.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {table: [row[1] for row in expected.execute(f"PRAGMA table_info({table})")] for table in tables}


class DatabaseUnusable(ValueError):
    """The database cannot be opened, read or written, or is not carpool's: `<path>: <cause>`."""


def connect(path: str | Path) -> sqlite3.Connection:
    """A connection with the schema in place. Waits up to 30 s for a lock rather than failing a write."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(SCHEMA)
        _add_missing_columns(conn)
    except (sqlite3.Error, OSError) as error:
        raise DatabaseUnusable(f"{path}: {_cause(error)}") from None
    return conn


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    for table, columns in ADDED_COLUMNS.items():
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for column in columns:
            if column.split()[0] not in present:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def check_database(conn: sqlite3.Connection, path: str | Path) -> None:
    """What a server checks before it serves: the file is sound, its tables are the ones this code writes, and
    it can be written. A damaged keys table otherwise passes /health and fails every keyed request with a 500.
    The whole check took 0.16 s on a 500,000-row (88 MB) ledger here."""
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise DatabaseUnusable(f"{path}: failed its integrity check: {problems[0]}")
        expected = sqlite3.connect(":memory:")
        expected.executescript(SCHEMA)
        for (table,) in expected.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            if _columns(conn, table) != _columns(expected, table):
                raise DatabaseUnusable(
                    f"{path}: table {table} is not the one carpool writes (columns "
                    f"{', '.join(_columns(conn, table)) or 'none'})"
                )
        # A write rolled back: a read-only file opens and reads fine, and fails only at its first write.
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("CREATE TABLE carpool_write_check (x)")
        finally:
            conn.execute("ROLLBACK")
    except sqlite3.Error as error:
        raise DatabaseUnusable(f"{path}: {_cause(error)}") from None


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [f"{row[1]} {row[2]}" for row in conn.execute(f"PRAGMA table_info({table})")]


def _cause(error: Exception) -> str:
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return str(error)
