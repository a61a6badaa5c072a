"""PostgreSQL for the stores several replicas share (`--db postgresql://...`): the economics database (keys,
ledger, budgets, rate limits) and the Batch API's metadata. Below both economics and the server, so each reaches
it without reaching into the other.

Migrations are the numbered SQL files in `carpool/migrations/`, applied in order on connect, each in its own
transaction and recorded in `schema_version`; an advisory lock makes replicas starting together apply each once.

`PostgresConnection` gives psycopg's connection the sqlite3 interface the SQLite code already speaks (`?`
parameters, rows readable by name and position, `with conn:` as one transaction), so keys, reports, the ledger
writer and the batch store run one set of SQL on both databases. Autocommit outside `with conn:`: a lone read
never leaves a transaction open on the server. psycopg (`make scale`) is imported only when a URL is opened.
"""

import re
import select
import threading
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit, urlunsplit

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_MIGRATION_LOCK = 0x63617270  # pg_advisory_lock id held while migrating ("carp")
_MIGRATION_NAME = re.compile(r"^(\d+)_\w+\.sql$")
# How long a statement may wait for a lock before failing (as SQLite's connect(timeout=30) does).
LOCK_TIMEOUT = "30s"
# How long opening a session may take (the URL's connect_timeout wins): libpq's default is to wait for the OS,
# minutes on an unreachable host, while every request on the connection waits too.
CONNECT_TIMEOUT = 5


class PostgresUnusable(ValueError):
    """The database cannot be reached or brought up to date: `<url without password>: <cause>`."""


def is_postgres_url(db: object) -> bool:
    """Whether `--db` names a PostgreSQL database rather than a SQLite file."""
    return isinstance(db, str) and db.startswith(("postgresql://", "postgres://"))


def redacted(url: str) -> str:
    """The URL without its password, fit for logs, error messages and a batch dir's owner file."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _psycopg():
    try:
        import psycopg
    except ImportError:
        raise PostgresUnusable(
            "a postgresql:// database needs psycopg 3, which is not installed; run `make scale` "
            "(pip install -r requirements-scale.txt)"
        ) from None
    return psycopg


def errors() -> tuple[type[Exception], ...]:
    """What a failed statement raises (PostgresUnusable: the session was lost and no new one opens)."""
    return (_psycopg().Error, PostgresUnusable)


class Row(tuple):
    """A result row read by position (unpacking) or by column name, and `dict(row)`: what sqlite3.Row offers."""

    _names: tuple[str, ...] = ()

    def __getitem__(self, index):
        if isinstance(index, str):
            return tuple.__getitem__(self, self._names.index(index))
        return tuple.__getitem__(self, index)

    def keys(self) -> list[str]:
        return list(self._names)


def _row_factory(cursor):
    names = tuple(column.name for column in cursor.description or ())
    row_type = type("Row", (Row,), {"_names": names})
    return row_type


class PostgresConnection:
    """One session, replaced when the server has dropped it (a restart, a failover, pg_terminate_backend): before
    each statement or transaction, an idle session whose socket has anything to read (the server's goodbye, or
    its end of file: an idle session is sent nothing else) is closed and a new one opened, so a long-lived
    server heals by itself instead of failing the next request on each of its connections."""

    def __init__(self, url: str):
        self.url = url
        self._conn = self._connect()
        self._transactions = threading.local()

    def _connect(self):
        psycopg = _psycopg()
        from psycopg.conninfo import conninfo_to_dict

        try:
            # Added to the URL's own options (a search_path, say), which a plain options= would replace.
            given = conninfo_to_dict(self.url)
            options = f"{given.get('options', '')} -c lock_timeout={LOCK_TIMEOUT}".strip()
            return psycopg.connect(
                self.url,
                autocommit=True,
                row_factory=_row_factory,
                options=options,
                connect_timeout=given.get("connect_timeout", CONNECT_TIMEOUT),
            )
        except psycopg.Error as error:
            raise PostgresUnusable(f"{redacted(self.url)}: {cause(error)}") from None

    @property
    def raw(self):
        """The psycopg connection itself."""
        return self._conn

    def _heal(self) -> None:
        if getattr(self._transactions, "stack", None):
            return  # inside a transaction: its session must stay; a lost one fails the transaction
        if self._conn.broken or self._conn.closed or select.select([self._conn.fileno()], [], [], 0)[0]:
            self._conn.close()
            self._conn = self._connect()

    def execute(self, sql: str, args: tuple | list = ()):
        self._heal()
        return self._conn.execute(_placeholders(sql), args or None)

    def executemany(self, sql: str, rows: list) -> None:
        with self._conn.cursor() as cursor:
            cursor.executemany(_placeholders(sql), rows)

    def __enter__(self) -> Self:
        self._heal()
        transaction = self._conn.transaction()
        transaction.__enter__()
        self._transactions.__dict__.setdefault("stack", []).append(transaction)
        return self

    def __exit__(self, *exc) -> None:
        self._transactions.stack.pop().__exit__(*exc)

    def close(self) -> None:
        self._conn.close()


def _placeholders(sql: str) -> str:
    """sqlite3's `?` parameters as psycopg's `%s` (a literal % doubled first). carpool's SQL puts no ? in text."""
    return sql.replace("%", "%%").replace("?", "%s")


def connect_postgres(url: str) -> PostgresConnection:
    """A connection to a database brought up to the newest migration; PostgresUnusable naming the database."""
    conn = PostgresConnection(url)
    try:
        migrate(conn)
    except errors() as error:
        conn.close()
        raise PostgresUnusable(f"{redacted(url)}: {cause(error)}") from None
    return conn


def migrations() -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of every migration, oldest first."""
    found = []
    for path in MIGRATIONS_DIR.iterdir():
        match = _MIGRATION_NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path.name, path.read_text(encoding="utf-8")))
    return sorted(found)


def migrate(conn: PostgresConnection) -> list[int]:
    """Apply the migrations the database lacks; the versions applied now."""
    applied_now = []
    conn.execute("SELECT pg_advisory_lock(?)", (_MIGRATION_LOCK,))
    try:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        done = {row[0] for row in conn.execute("SELECT version FROM schema_version")}
        for version, name, sql in migrations():
            if version in done:
                continue
            with conn:
                conn.raw.execute(sql)  # several statements: no parameters, so sent as they are
                conn.execute("INSERT INTO schema_version (version, name) VALUES (?, ?)", (version, name))
            applied_now.append(version)
    finally:
        conn.execute("SELECT pg_advisory_unlock(?)", (_MIGRATION_LOCK,))
    return applied_now


def check_writable(conn: PostgresConnection) -> None:
    """Raise unless the database takes writes (a read-only role connects and reads fine): a table created and
    rolled back."""
    try:
        with conn:
            conn.execute("CREATE TABLE carpool_write_check (x INTEGER)")
            raise _RolledBack
    except _RolledBack:
        pass


class _RolledBack(Exception):
    """Raised inside a transaction to roll it back on purpose."""


def cause(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
