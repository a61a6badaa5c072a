"""Batches, files and per-request results: a database plus a files/ folder, under the batch dir.

The database is batches.db in the batch dir, or, for replicas sharing a PostgreSQL `--db`, that database (the
same tables, carpool/migrations/002_batches.sql, and the same SQL: carpool.postgres speaks sqlite3's interface);
the files/ folder must then be one every replica reads and writes (a shared mount), as each replica may be
asked for any file and may run any batch. A batch is run by one server at a time: on SQLite the whole dir is
one server's (carpool.server.batch.home); on PostgreSQL each batch has a lease row (owner, expiry) that its server
renews (`renew_claims`), so a killed server's batches are free for another CLAIM_SECONDS later. A lease, not a
session lock: a dropped session (a database restart) freed a session lock at once while its server still ran the
batch's lines, so a second server could run, and bill, the same lines. A server that cannot renew stops running
the batch before its lease can lapse (`renew_claims` says which), so the two never overlap.

Everything a batch needs to survive `kill -9` is here. A result is written the moment its request finishes,
keyed by (batch, line) and unique by (batch, custom_id), so a restarted server re-runs only the lines that
have no result and no custom_id is ever answered twice. Output and error files are assembled from the
results at the end, written beside the database and registered in the same transaction that closes the batch.
"""

import json
import os
import secrets
import socket
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

from carpool import postgres

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- listing order; ids are random
    id TEXT NOT NULL UNIQUE,
    owner TEXT,                             -- tenant or key id of the uploader; NULL on an open server
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,                  -- batch (uploaded) | batch_output (written here)
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT,
    key_id TEXT,                            -- who pays: kept so a restarted server bills the same key
    tenant TEXT,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    metadata TEXT,                          -- JSON object
    errors TEXT,                            -- JSON list of validation errors
    output_file_id TEXT,
    error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,                  -- 1-based line of the input file
    custom_id TEXT NOT NULL,
    ok INTEGER NOT NULL,                    -- 1: output file, 0: error file
    record TEXT NOT NULL,                   -- the JSON line as it will appear in that file
    PRIMARY KEY (batch_id, line),
    UNIQUE (batch_id, custom_id)
);
"""

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TIMESTAMPS = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}
_UPDATABLE = {"total", "errors"}
_COPY_CHUNK = 1 << 20
# A batch's lease: long enough for a database restart or failover to pass without a server losing its batches, short
# enough that a killed server's batches resume within a minute. Renewed every ADOPT_SECONDS (5 s) by the runner.
CLAIM_SECONDS = 30.0
_DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
# On a shared files folder another replica may be mid-upload (or mid-finalize) on a file not registered yet: only
# files older than this count as left by a dead process.
SHARED_ORPHAN_SECONDS = 3600


class FileTooLarge(Exception):
    pass


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class BatchStore:
    def __init__(self, root: str | Path, db: str | None = None):
        """`db`: a PostgreSQL URL that holds the metadata of every replica's batches (None: batches.db in `root`)."""
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # Touched from the event loop and from worker threads (uploads, validation): one connection, one lock.
        self._lock = threading.Lock()
        self.shared = postgres.is_postgres_url(db)
        if self.shared:
            self._conn = postgres.connect_postgres(db)
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
            # batch id -> time.monotonic() by which its lease may lapse: taken before the statement that set the
            # lease, so it is never later than the database's expiry.
            self._leases: dict[str, float] = {}
        else:
            self._conn = sqlite3.connect(self.root / "batches.db", timeout=30, check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a killed process
            self._conn.executescript(SCHEMA)
        self._remove_orphans()

    def close(self) -> None:
        """Closing hands this server's batches on at once; a killed server's are free once their leases lapse."""
        with self._lock:
            if self.shared and self._leases:
                try:
                    self._conn.execute("DELETE FROM batch_claims WHERE owner = ?", (self.owner,))
                except postgres.errors():
                    pass  # the database is away: the leases lapse on their own
            self._conn.close()

    def claim(self, batch_id: str) -> bool:
        """Whether this server may run the batch now: no other live server holds its lease. Hold it until
        `release`, renewing it with `renew_claims`."""
        if not self.shared:
            return True  # the batch dir, and so every batch in it, is this server's alone
        with self._lock:
            sent = time.monotonic()
            row = self._conn.execute(
                f"INSERT INTO batch_claims (batch_id, owner, expires_at) VALUES (?, ?, {_DB_NOW} + ?) "
                f"ON CONFLICT (batch_id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at "
                f"WHERE batch_claims.owner = excluded.owner OR batch_claims.expires_at <= {_DB_NOW} "
                "RETURNING batch_id",
                (batch_id, self.owner, CLAIM_SECONDS),
            ).fetchone()
            if row is not None:
                self._leases[batch_id] = sent + CLAIM_SECONDS
            return row is not None

    def renew_claims(self, batch_ids: list[str], horizon: float) -> list[str]:
        """Renew this server's leases on `batch_ids`; the ones it must stop running now: those another server
        holds (this one's lapsed), and, while the database cannot be reached, those that may lapse within
        `horizon` seconds (before the caller's next renewal), so no two servers ever run a batch at once."""
        if not self.shared or not batch_ids:
            return []
        with self._lock:
            sent = time.monotonic()
            try:
                renewed = {
                    row[0]
                    for row in self._conn.execute(
                        f"UPDATE batch_claims SET expires_at = {_DB_NOW} + ? WHERE owner = ? AND batch_id = ANY(?) "
                        f"AND expires_at > {_DB_NOW} RETURNING batch_id",
                        (CLAIM_SECONDS, self.owner, list(batch_ids)),
                    )
                }
            except postgres.errors():
                return [batch_id for batch_id in batch_ids if self._leases.get(batch_id, 0.0) - horizon <= sent]
            for batch_id in renewed:
                self._leases[batch_id] = sent + CLAIM_SECONDS
            return [batch_id for batch_id in batch_ids if batch_id not in renewed]

    def release(self, batch_id: str) -> None:
        if self.shared:
            with self._lock:
                self._leases.pop(batch_id, None)
                try:
                    self._conn.execute(
                        "DELETE FROM batch_claims WHERE batch_id = ? AND owner = ?", (batch_id, self.owner)
                    )
                except postgres.errors():
                    pass  # the database is away: the lease lapses on its own

    def check_writable(self) -> None:
        """Raise (OSError, sqlite3.Error) unless both the files folder and the database take writes: a read-only
        store opens and reads fine, and would fail only at its first upload."""
        with tempfile.TemporaryFile(dir=self.files_dir):
            pass
        with self._lock:
            if self.shared:
                postgres.check_writable(self._conn)
                return
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute("CREATE TABLE carpool_write_check (x)")
            finally:
                self._conn.execute("ROLLBACK")

    def _query(self, sql: str, args: tuple = ()) -> list[dict]:
        with self._lock:
            return [dict(row) for row in self._conn.execute(sql, args)]

    def _remove_orphans(self) -> None:
        """Files written by a process that died before registering them (an upload or a finalize cut short)."""
        known = {row["id"] for row in self._query("SELECT id FROM files")}
        written_before = time.time() - SHARED_ORPHAN_SECONDS if self.shared else float("inf")
        for path in self.files_dir.iterdir():
            if path.name not in known and path.stat().st_mtime < written_before:
                path.unlink(missing_ok=True)

    # Files ---------------------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def save_file(
        self, owner: str | None, filename: str, purpose: str, source: BinaryIO, max_bytes: int, now: int
    ) -> dict:
        """Copy an upload into the store; FileTooLarge (and nothing kept) past max_bytes."""
        file_id = new_id("file-")
        path = self.file_path(file_id)
        size = 0
        try:
            with open(path, "wb") as out:
                while chunk := source.read(_COPY_CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(f"file is larger than the limit of {max_bytes} bytes")
                    out.write(chunk)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO files (id, owner, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, owner, filename, purpose, size, now),
            )
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict | None:
        rows = self._query("SELECT * FROM files WHERE id = ?", (file_id,))
        return rows[0] if rows else None

    def list_files(
        self, owner: str | None, everyone: bool, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[dict], bool]:
        filters = [("purpose = ?", purpose)] if purpose is not None else []
        return self._page("files", owner, everyone, after, limit, newest_first, filters)

    def _page(
        self,
        table: str,
        owner: str | None,
        everyone: bool,
        after: str | None,
        limit: int,
        newest_first: bool,
        filters: list[tuple[str, object]] = (),
    ) -> tuple[list[dict], bool]:
        """One page of the caller's rows of `table` in creation order, starting after the row `after`;
        and whether more rows follow."""
        where, args = ["TRUE"], []
        if not everyone:
            where.append("owner IS NOT DISTINCT FROM ?")
            args.append(owner)
        for clause, value in filters:
            where.append(clause)
            args.append(value)
        if after is not None:
            where.append(f"seq {'<' if newest_first else '>'} COALESCE((SELECT seq FROM {table} WHERE id = ?), -1)")
            args.append(after)
        order = "DESC" if newest_first else "ASC"
        rows = self._query(
            f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?", (*args, limit + 1)
        )
        return rows[:limit], len(rows) > limit

    def file_in_use(self, file_id: str) -> bool:
        """An unfinished batch still reads it."""
        marks = ",".join("?" * len(ACTIVE))
        rows = self._query(
            f"SELECT 1 FROM batches WHERE input_file_id = ? AND status IN ({marks}) LIMIT 1", (file_id, *ACTIVE)
        )
        return bool(rows)

    def delete_file(self, file_id: str) -> None:
        with self._lock, self._conn:
            self._conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    # Batches -------------------------------------------------------------------------------------------

    def create_batch(
        self,
        *,
        owner: str | None,
        key_id: str | None,
        tenant: str | None,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict | None,
        created_at: int,
        expires_at: int,
    ) -> dict:
        batch_id = new_id("batch_")
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO batches (id, owner, key_id, tenant, endpoint, input_file_id, completion_window, status, "
                "metadata, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
                (
                    batch_id,
                    owner,
                    key_id,
                    tenant,
                    endpoint,
                    input_file_id,
                    completion_window,
                    None if metadata is None else json.dumps(metadata),
                    created_at,
                    expires_at,
                ),
            )
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict | None:
        rows = self._query("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return rows[0] if rows else None

    def list_batches(
        self,
        owner: str | None,
        everyone: bool,
        after: str | None,
        limit: int,
        endpoint: str | None = None,
        newest_first: bool = True,
    ) -> tuple[list[dict], bool]:
        """Newest first, as OpenAI lists them; `endpoint`: only the batches of that endpoint."""
        filters = [("endpoint = ?", endpoint)] if endpoint is not None else []
        return self._page("batches", owner, everyone, after, limit, newest_first, filters)

    def delete_batch(self, batch_id: str) -> None:
        """A finished batch, its results and its files (input, output and error), for good."""
        batch = self.get_batch(batch_id)
        file_ids = [batch[name] for name in ("input_file_id", "output_file_id", "error_file_id") if batch[name]]
        with self._lock, self._conn:
            self._conn.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
            self._conn.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
            for file_id in file_ids:
                self._conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
        for file_id in file_ids:
            self.file_path(file_id).unlink(missing_ok=True)

    def active_batch_ids(self) -> list[str]:
        marks = ",".join("?" * len(ACTIVE))
        rows = self._query(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE)
        return [row["id"] for row in rows]

    def transition(self, batch_id: str, status: str, now: int, allowed_from: tuple[str, ...], **fields) -> bool:
        """Move the batch to `status` (stamping its `<status>_at`) only if it is in one of `allowed_from`.

        The check and the write are one statement, so a cancel and the runner's own next move can't both win.
        """
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        if "errors" in fields:
            fields["errors"] = json.dumps(fields["errors"])
        with self._lock, self._conn:
            return self._set_status(batch_id, status, now, allowed_from, fields)

    def _set_status(self, batch_id: str, status: str, now: int, allowed_from: tuple[str, ...], fields: dict) -> bool:
        """The conditional status write itself; the caller holds the lock and the transaction."""
        columns = {"status": status, TIMESTAMPS[status]: now, **fields}
        assignments = ", ".join(f"{name} = ?" for name in columns)
        marks = ",".join("?" * len(allowed_from))
        cursor = self._conn.execute(
            f"UPDATE batches SET {assignments} WHERE id = ? AND status IN ({marks})",
            (*columns.values(), batch_id, *allowed_from),
        )
        return cursor.rowcount == 1

    # Results -------------------------------------------------------------------------------------------

    def add_result(
        self,
        batch_id: str,
        line: int,
        custom_id: str,
        ok: bool,
        record: dict,
        input_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
    ) -> bool:
        """Keep a request's outcome; False (and nothing changed) if that line or custom_id already has one."""
        with self._lock, self._conn:
            cursor = self._conn.execute(
                "INSERT INTO results (batch_id, line, custom_id, ok, record) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (batch_id, line, custom_id, int(ok), json.dumps(record, ensure_ascii=False)),
            )
            if cursor.rowcount != 1:
                return False
            self._conn.execute(
                f"UPDATE batches SET {'completed' if ok else 'failed'} = {'completed' if ok else 'failed'} + 1, "
                "input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? "
                "WHERE id = ?",
                (input_tokens, cached_tokens, output_tokens, batch_id),
            )
        return True

    def answered_lines(self, batch_id: str) -> set[int]:
        return {row["line"] for row in self._query("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def close_batch(self, batch_id: str, status: str, now: int, allowed_from: tuple[str, ...]) -> bool:
        """Write the output and error files from the results and move the batch to its final `status`.

        The files are registered in the same transaction as the status change; if the process dies before it,
        the unregistered files are swept at the next start and this runs again.
        """
        batch = self.get_batch(batch_id)
        written = {ok: self._write_results(batch, ok, now) for ok in (True, False)}
        output, errors = written[True], written[False]
        files = {"output_file_id": output and output["id"], "error_file_id": errors and errors["id"]}
        with self._lock, self._conn:
            closed = self._set_status(batch_id, status, now, allowed_from, files)
            if closed:
                for row in filter(None, written.values()):
                    self._conn.execute(
                        "INSERT INTO files (id, owner, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                        (row["id"], row["owner"], row["filename"], row["purpose"], row["bytes"], row["created_at"]),
                    )
        if not closed:
            for row in filter(None, written.values()):
                self.file_path(row["id"]).unlink(missing_ok=True)
        return closed

    def _write_results(self, batch: dict, ok: bool, now: int) -> dict | None:
        """One results file (successes or errors) on disk, not yet registered; None if there is nothing to write."""
        file_id = new_id("file-")
        path = self.file_path(file_id)
        size = 0
        # A cursor of its own, read in pages, so a 50,000-line batch never sits in memory at once.
        last_line = 0
        with open(path, "wb") as out:
            while True:
                rows = self._query(
                    "SELECT line, record FROM results WHERE batch_id = ? AND ok = ? AND line > ? "
                    "ORDER BY line LIMIT 1000",
                    (batch["id"], int(ok), last_line),
                )
                if not rows:
                    break
                for row in rows:
                    data = (row["record"] + "\n").encode()
                    out.write(data)
                    size += len(data)
                last_line = rows[-1]["line"]
        if size == 0:
            path.unlink()
            return None
        kind = "output" if ok else "error"
        return {
            "id": file_id,
            "owner": batch["owner"],
            "filename": f"{batch['id']}_{kind}.jsonl",
            "purpose": "batch_output",
            "bytes": size,
            "created_at": now,
        }
