"""The ledger writer: one row per finished or aborted request, appended by a thread of its own.

A row is durable before its client hears of the request. `submit` puts the row on a queue and returns a Future
that resolves once the row's transaction has committed; the server holds the response's last byte (a
non-streamed body, a stream's usage chunk and [DONE]) until then, so a `kill -9` never loses a row for a
request the client was told succeeded. The writer drains whatever has queued up and commits it in one
transaction: rows are never half-written, and a burst of finishing requests shares one commit (one fsync,
about 4 ms here, in synchronous=FULL WAL mode; 64 rows commit in the same 4 ms), so the wait costs each
request one commit's latency and the server no throughput: the engine never waits on it.

A commit that fails (disk full, file made read-only, a lock held past the timeout) fails its rows' Futures, so
those clients get an error instead of a success, and marks the ledger unhealthy (`problem`): the gate stops
admitting billable work until a retry, every RETRY_SECONDS, writes the held rows and clears it. Those requests
ran but their clients never got the result, so their rows are written as `withheld` at no cost: the operator
still sees the compute, and a client that retries is billed once, for the answer it received.

A billed row's `request_id` is unique in the ledger (a partial unique index: withheld rows may repeat an id). It is
the `x-request-id` the client saw (contract.UsageRecord says how the parts of one request are named), so a second
request sent with an id already billed is written as withheld, and its client is answered 409 instead of the
result (`DuplicateRequestId`): one id, one charge, whichever replica wrote the first.
"""

import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from carpool.economics.contract import WITHHELD, UsageRecord
from carpool.economics.db import DatabaseUnusable, connect, is_postgres_url, open_database
from carpool.postgres import errors as postgres_errors

log = logging.getLogger(__name__)

_INSERT = (
    "INSERT INTO ledger (time, request_id, key_id, tenant, model, tier, uncached_prompt_tokens, cache_read_tokens,"
    " cache_write_tokens, output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost,"
    " purpose, parent_request_id, cascade, cascade_step, cascade_accepted, constraint_kind, original_prompt_tokens,"
    " cache_write_5m_tokens, cache_write_1h_tokens, arrived, prompt_block_chain)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    # The index db.SCHEMA's ledger_request_id (and migration 006) make: a billed row whose id is taken is skipped.
    " ON CONFLICT (request_id) WHERE finish_reason <> 'withheld' DO NOTHING"
)
_MAX_ROWS_PER_COMMIT = 1000
RETRY_SECONDS = 1.0


class LedgerUnwritable(Exception):
    """The row could not be committed; the message says why."""


class DuplicateRequestId(Exception):
    """A billed row already holds this request id: the row was written as withheld, at no cost."""

    def __init__(self, request_id: str):
        super().__init__(request_id)
        self.request_id = request_id


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
        usage.purpose,
        usage.parent_request_id,
        usage.cascade,
        usage.cascade_step,
        None if usage.cascade_accepted is None else int(usage.cascade_accepted),
        usage.constraint_kind,
        usage.original_prompt_tokens,
        usage.cache_write_5m_tokens,
        usage.cache_write_1h_tokens,
        usage.arrived,
        usage.prompt_block_chain,
    )


_REQUEST_ID, _FINISH_REASON = 1, 13  # ledger_row's positions of request_id, and of finish_reason and cost


def withheld_row(row: tuple) -> tuple:
    """The row of a request whose result was withheld: its tokens and timings, no cost."""
    return (*row[:_FINISH_REASON], WITHHELD, 0.0, *row[_FINISH_REASON + 2 :])


# In the transaction that writes rows: what else must commit with them, given (row, reservation) pairs (a shared
# database settles the requests' budget reservations there: carpool/economics/shared_admission.py).
Settle = Callable[[object, list[tuple[tuple, object]]], None]


Held = tuple[tuple, Future, object]  # a row, the Future its commit resolves, and what it settles


def _open(db: str | Path):
    return open_database(db) if is_postgres_url(db) else connect(db)


class LedgerWriter:
    def __init__(self, db_path: str | Path, settle: Settle | None = None):
        self.db_path = db_path
        self._settle = settle
        self._errors: tuple[type[Exception], ...] = (sqlite3.Error, DatabaseUnusable)
        if is_postgres_url(db_path):
            self._errors += postgres_errors()
        self.problem: str | None = None  # why the last commit failed; None once a commit succeeds
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # a row is queued before close() queues its stop, or refused
        _open(db_path).close()  # create the schema now, so a bad path fails at startup, not at the first row
        self._thread = threading.Thread(target=self._run, name="carpool-ledger", daemon=True)
        self._thread.start()

    def submit(self, usage: UsageRecord, cost: float, reservation: object = None) -> Future:
        """Queue one row; returns at once, with a Future that resolves when the row is committed. `reservation`
        goes to `settle` with the row."""
        written: Future = Future()
        with self._closing:
            if not self._closed:
                self._queue.put((ledger_row(usage, cost), written, reservation))
                return written
        log.error("ledger %s; row not written: %r cost=%r", self.problem or "closed", usage, cost)
        written.set_exception(LedgerUnwritable(self.problem or "the ledger is closed"))
        return written

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every row submitted so far has been tried (committed, unless `problem` says otherwise);
        False if `timeout` passed first."""
        if self._closed:
            return not self._thread.is_alive()
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float | None = 30) -> None:
        """Commit what is queued and stop the thread. Call it once nothing records any more (engine stopped)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        conn = _open(self.db_path)
        held: list[Held] = []  # rows whose commit failed, retried until one succeeds
        try:
            stopping = False
            while not stopping:
                try:
                    items = [self._queue.get(timeout=RETRY_SECONDS if held else None)]
                except queue.Empty:
                    items = []
                while len(items) < _MAX_ROWS_PER_COMMIT:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                held += [item for item in items if isinstance(item, tuple)]
                if held:
                    held = self._commit(conn, held)
                for item in items:
                    if isinstance(item, threading.Event):
                        item.set()
                    elif item is None:
                        stopping = True
            if held:  # still failing at shutdown: the log keeps them, in full, for a replay by hand
                log.error("ledger: %d rows not written: %r", len(held), [item[0] for item in held])
        except BaseException as error:  # the writer is gone: say so (the gate then refuses billable work), and
            # fail every waiting response rather than leave it hanging on a row nobody will commit
            with self._closing:  # from here submit() refuses rows, so the drain below misses none
                self.problem = f"the usage ledger writer stopped: {error!r}"
                self._closed = True
            log.exception("ledger %s: writer stopped", self.db_path)
            pending = list(held)
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if isinstance(item, tuple):
                    pending.append(item)
                elif isinstance(item, threading.Event):
                    item.set()
            for row, written, _ in pending:
                log.error("ledger: row not written: %r", row)
                if not written.done():
                    written.set_exception(LedgerUnwritable(self.problem))
        finally:
            conn.close()

    def _commit(self, conn, rows: list[Held]) -> list[Held]:
        """Commit the rows in one transaction; the rows still to write (all of them, if it failed)."""
        try:
            with conn:
                written, duplicates = [], set()
                for index, (row, _, reservation) in enumerate(rows):
                    if conn.execute(_INSERT, row).rowcount == 0:  # its id is billed already: kept, but not billed
                        row = withheld_row(row)
                        conn.execute(_INSERT, row)
                        duplicates.add(index)
                    written.append((row, reservation))
                if self._settle is not None:
                    self._settle(conn, written)
        except self._errors as error:
            if self.problem is None:
                log.error(
                    "ledger %s: %d rows not written (%s); refusing billable requests until it can write",
                    self.db_path,
                    len(rows),
                    error,
                )
            self.problem = f"the usage ledger cannot be written: {error}"
            for _, written, _ in rows:
                if not written.done():
                    written.set_exception(LedgerUnwritable(self.problem))
            return [(withheld_row(row), written, reservation) for row, written, reservation in rows]
        if self.problem is not None:
            log.warning("ledger %s: writable again; %d held rows written", self.db_path, len(rows))
        self.problem = None
        for index, (row, future, _) in enumerate(rows):
            if future.done():
                continue
            if index in duplicates:
                future.set_exception(DuplicateRequestId(row[_REQUEST_ID]))
            else:
                future.set_result(None)
        return []
