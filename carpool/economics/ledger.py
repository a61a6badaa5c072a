"""The ledger writer: one row per finished or aborted request, appended by a thread of its own.

`submit` only puts the row on a queue, so the engine loop that reports a finished request never waits for the
disk. The writer drains whatever has queued up and commits it in one transaction: rows are never half-written,
and a burst of finishing requests costs one commit, not one each.
"""

import logging
import queue
import sqlite3
import threading
from pathlib import Path

from carpool.economics.db import connect
from carpool.economics.usage import UsageRecord

log = logging.getLogger(__name__)

_INSERT = (
    "INSERT INTO ledger (time, request_id, key_id, tenant, model, tier, uncached_prompt_tokens, cache_read_tokens,"
    " cache_write_tokens, output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_MAX_ROWS_PER_COMMIT = 1000


def ledger_row(usage: UsageRecord, cost: float) -> tuple:
    return (
        usage.created,
        usage.request_id,
        usage.key_id,
        usage.tenant,
        usage.model,
        usage.tier,
        usage.uncached_prompt_tokens,
        usage.cached_tokens,
        usage.cache_write_tokens,
        usage.output_tokens,
        usage.queue_seconds,
        usage.prefill_seconds,
        usage.decode_seconds,
        usage.finish_reason,
        cost,
    )


class LedgerWriter:
    def __init__(self, db_path: str | Path):
        self.db_path = db_path
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        connect(db_path).close()  # create the schema now, so a bad path fails at startup, not at the first row
        self._thread = threading.Thread(target=self._run, name="carpool-ledger", daemon=True)
        self._thread.start()

    def submit(self, usage: UsageRecord, cost: float) -> None:
        """Queue one row; returns at once."""
        if self._closed:
            log.error("ledger closed; row not written: %r cost=%r", usage, cost)
            return
        self._queue.put(ledger_row(usage, cost))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every row submitted so far is committed; False if `timeout` passed first."""
        if self._closed:
            return not self._thread.is_alive()
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float | None = 30) -> None:
        """Commit what is queued and stop the thread. Call it once nothing records any more (engine stopped)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        conn = connect(self.db_path)
        try:
            stopping = False
            while not stopping:
                items = [self._queue.get()]
                while len(items) < _MAX_ROWS_PER_COMMIT:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                rows = [item for item in items if isinstance(item, tuple)]
                if rows:
                    self._commit(conn, rows)
                for item in items:
                    if isinstance(item, threading.Event):
                        item.set()
                    elif item is None:
                        stopping = True
        finally:
            conn.close()

    @staticmethod
    def _commit(conn: sqlite3.Connection, rows: list[tuple]) -> None:
        try:
            with conn:
                conn.executemany(_INSERT, rows)
        except sqlite3.Error:
            # The thread must outlive a bad moment (disk full, a lock held past the timeout): log the rows in
            # full so they can be replayed, and keep serving.
            log.exception("ledger: %d rows not written: %r", len(rows), rows)
