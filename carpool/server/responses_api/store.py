"""Stored responses (`store`, the default): what `GET /v1/responses/{id}` answers and what `previous_response_id`
continues, each row its API key's alone (another key's id is as unknown as an id never made). A row holds the
whole context its response answered, earlier turns included, so deleting an earlier response of a chain leaves
the later ones whole and continuable.

Where the Batch API keeps its metadata, for the same reasons (carpool.server.batch.store): responses.db in the
batch dir, or for replicas sharing a PostgreSQL `--db`, that database (carpool/migrations/004_responses.sql), so
any replica continues any response. An app built without a batch dir keeps them in memory for its life.
"""

import json
import sqlite3
import threading
from pathlib import Path

from carpool import postgres

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, created_at);
"""
OPEN_SERVER_OWNER = ""  # the key id of every caller of a server without keys: they are one caller


class ResponseStore:
    def __init__(self, root: str | Path | None, db: str | None = None):
        """`root`: the batch dir (None: in memory); `db`: a PostgreSQL URL that holds every replica's responses."""
        self._lock = threading.Lock()  # one connection, used from worker threads (the routes keep I/O off the loop)
        if postgres.is_postgres_url(db):
            self._conn = postgres.connect_postgres(db)
            return
        if root is not None:
            Path(root).mkdir(parents=True, exist_ok=True)
        path = ":memory:" if root is None else Path(root) / "responses.db"
        self._conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a killed process
        self._conn.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def save(self, owner: str | None, response: dict, context: list[dict]) -> None:
        """`context`: the input items `response` answered (a continuation's earlier turns included)."""
        row = (response["id"], _owner(owner), int(response["created_at"]), json.dumps(response), json.dumps(context))
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO responses (id, owner, created_at, response, context) VALUES (?, ?, ?, ?, ?)", row
            )

    def get(self, owner: str | None, response_id: str) -> tuple[dict, list[dict]] | None:
        """(the response, its context), or None when `owner` has no response of that id."""
        with self._lock:
            row = self._conn.execute(
                "SELECT response, context FROM responses WHERE id = ? AND owner = ?", (response_id, _owner(owner))
            ).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, owner: str | None, response_id: str) -> bool:
        with self._lock, self._conn:
            deleted = self._conn.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ? RETURNING id", (response_id, _owner(owner))
            ).fetchone()
        return deleted is not None


def _owner(key_id: str | None) -> str:
    return OPEN_SERVER_OWNER if key_id is None else key_id
