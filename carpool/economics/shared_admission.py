"""Budgets and rate limits that hold across replicas: the admission state kept in PostgreSQL, not in memory.

Two replicas admitting the last dollar of a budget at the same moment must not both pass. So admission reserves
what a request may cost at most (its prompt and max_tokens at the dearest price: PriceSheet.worst_case_cost)
and admits it only while spent + reserved + that estimate stays within the budget; the reservation is deleted,
and the real cost added to `budget_spend`, in the transaction that writes the request's ledger row (`settle`).
Admissions of one key queue on a transaction-scoped advisory lock, and read spend and reservations in one
statement (one snapshot), so a row settling between two reads cannot make money appear twice or vanish.

The rate limit's sliding window is the `rate_events` table, judged by the same check_window as one process's.

A replica that dies leaves its reservations behind: they lapse LEASE_SECONDS after it stops renewing them (a
live gate renews its own every LEASE_SECONDS / 3, for at most MAX_RESERVATION_SECONDS per request). Lease times
are the database's clock, so replicas on machines whose clocks differ agree on them.
"""

import contextlib
import os
import secrets
import socket
import threading

from carpool import postgres
from carpool.economics.budget import check_budget
from carpool.economics.contract import GateError, UsageRecord
from carpool.economics.db import open_database
from carpool.economics.keys import ApiKey
from carpool.economics.rate_limit import WINDOW_SECONDS, RateLimitExceeded, check_window
from carpool.economics.spend import PERIODS, period_start
from carpool.postgres import PostgresConnection

LEASE_SECONDS = 60.0
MAX_RESERVATION_SECONDS = 3600.0  # a request still unrecorded after an hour never will be (its row was lost)
UNAVAILABLE_RETRY_SECONDS = 1.0  # a dropped session is replaced at the next statement; a restart takes seconds
_DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
_ROW_TIME, _ROW_KEY, _ROW_COST = 0, 2, 14  # positions in ledger.ledger_row


class SharedAdmission:
    def __init__(self, url: str):
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._conn: PostgresConnection = open_database(url)
        self._lock = threading.Lock()  # one connection, used by the server's threads and the renewer
        # (request id, key id) -> its reservations' ids, until their rows are recorded (a client may send one id twice)
        self._reservations: dict[tuple[str, str], list[int]] = {}
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="carpool-reservations", daemon=True)
        self._renewer.start()

    def admit(
        self, key: ApiKey, estimated_tokens: int, estimated_cost: float, request_id: str | None, now: float
    ) -> None:
        """Raise GateError (429) unless the key has budget and rate left; else count the request and, when a
        `request_id` will be recorded, reserve `estimated_cost` for it until then."""
        if key.budget is None and key.rpm is None and key.tpm is None:
            return
        with database_unavailable(), self._lock, self._conn:
            self._conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (key.key_id,))
            if key.budget is not None:
                self._check_budget(key, estimated_cost, now)
            if key.rpm is not None or key.tpm is not None:
                self._count_rate(key, estimated_tokens, now)
            if key.budget is not None and request_id is not None:
                (reservation,) = self._conn.execute(
                    f"INSERT INTO reservations (key_id, holder, amount, created, expires_at) "
                    f"VALUES (?, ?, ?, {_DB_NOW}, {_DB_NOW} + ?) RETURNING id",
                    (key.key_id, self.holder, estimated_cost, LEASE_SECONDS),
                ).fetchone()
                self._reservations.setdefault((request_id, key.key_id), []).append(reservation)

    def _check_budget(self, key: ApiKey, estimated_cost: float, now: float) -> None:
        spent, reserved = self._conn.execute(  # one statement: one snapshot of both
            "SELECT COALESCE((SELECT spent FROM budget_spend WHERE key_id = ? AND period = ? AND period_start = ?), 0),"
            f" COALESCE((SELECT SUM(amount) FROM reservations WHERE key_id = ? AND expires_at > {_DB_NOW}), 0)",
            (key.key_id, key.budget_period, period_start(key.budget_period, now), key.key_id),
        ).fetchone()
        check_budget(key, spent, reserved, estimated_cost)

    def _count_rate(self, key: ApiKey, tokens: int, now: float) -> None:
        """Totals first: the window's rows are read only to say when to retry (a key admitting 1,000 requests a
        minute would otherwise read 1,000 rows per admission)."""
        args = (key.key_id, now - WINDOW_SECONDS)
        requests, used = self._conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(tokens), 0) FROM rate_events WHERE key_id = ? AND admitted_at > ?", args
        ).fetchone()
        over_rpm = key.rpm is not None and requests + 1 > key.rpm
        over_tpm = key.tpm is not None and used + tokens > key.tpm
        if over_rpm or over_tpm:
            window = [
                tuple(row)
                for row in self._conn.execute(
                    "SELECT admitted_at, tokens FROM rate_events WHERE key_id = ? AND admitted_at > ? "
                    "ORDER BY admitted_at",
                    args,
                )
            ]
            try:
                check_window(window, tokens, key.rpm, key.tpm, now)
            except RateLimitExceeded as limited:
                raise GateError(429, limited.message, "rate_limit_exceeded", retry_after=limited.retry_after) from None
        self._conn.execute("DELETE FROM rate_events WHERE key_id = ? AND admitted_at <= ?", args)
        self._conn.execute(
            "INSERT INTO rate_events (key_id, admitted_at, tokens) VALUES (?, ?, ?)", (key.key_id, now, tokens)
        )

    def recorded(self, usage: UsageRecord, cost: float) -> int | None:
        """The reservation the request's ledger row settles (None: nothing was reserved for it). Its cost counts
        against the budget when that row commits (`settle`); until then the reservation holds its place."""
        with self._lock:
            held = self._reservations.get((usage.request_id, usage.key_id))
            if not held:
                return None
            reservation = held.pop(0)
            if not held:
                del self._reservations[(usage.request_id, usage.key_id)]
            return reservation

    def withheld(self, usage: UsageRecord, cost: float) -> None:
        """Nothing to refund: the row is written as withheld at no cost, and settles the reservation then."""

    def spent(self, key_id: str | None, period: str, now: float) -> float:
        with self._lock:
            row = self._conn.execute(
                "SELECT spent FROM budget_spend WHERE key_id = ? AND period = ? AND period_start = ?",
                (key_id, period, period_start(period, now)),
            ).fetchone()
        return row[0] if row is not None else 0.0

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 3):
            try:
                with self._lock, self._conn:
                    self._conn.execute(
                        f"UPDATE reservations SET expires_at = {_DB_NOW} + ? "
                        f"WHERE holder = ? AND created > {_DB_NOW} - ?",
                        (LEASE_SECONDS, self.holder, MAX_RESERVATION_SECONDS),
                    )
                    self._conn.execute(f"DELETE FROM reservations WHERE expires_at <= {_DB_NOW}")
            except Exception:  # the database is away: admission fails on its own; renew again next time
                continue

    def close(self) -> None:
        self._stop.set()
        self._renewer.join(timeout=5)
        with self._lock:
            self._conn.close()


@contextlib.contextmanager
def database_unavailable():
    """A statement that failed because the database is away (a restart, a partition, a dropped session that could
    not be replaced) as GateError 503 with a Retry-After: the client's request is fine, and a retry (after the
    connection heals) will get through."""
    try:
        yield
    except postgres.errors() as error:
        raise GateError(
            503,
            f"The database that holds keys, budgets and rate limits cannot be reached "
            f"({postgres.cause(error)}); retry shortly.",
            "database_unavailable",
            retry_after=UNAVAILABLE_RETRY_SECONDS,
        ) from None


def settle(conn: PostgresConnection, rows: list[tuple[tuple, int | None]]) -> None:
    """In the ledger writer's transaction: add each row's cost to its key's spend in both periods, and delete the
    reservation it settles. Upserts go in key order, so two replicas' writers never deadlock on each other's rows."""
    totals: dict[tuple[str, str, float], float] = {}
    for row, _ in rows:
        key_id, cost = row[_ROW_KEY], row[_ROW_COST]
        if key_id is not None and cost:
            for period in PERIODS:
                at = (key_id, period, period_start(period, row[_ROW_TIME]))
                totals[at] = totals.get(at, 0.0) + cost
    for (key_id, period, start), cost in sorted(totals.items()):
        conn.execute(
            "INSERT INTO budget_spend (key_id, period, period_start, spent) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (key_id, period, period_start) "
            "DO UPDATE SET spent = budget_spend.spent + excluded.spent",
            (key_id, period, start, cost),
        )
    reservations = sorted(reservation for _, reservation in rows if reservation is not None)
    if reservations:
        conn.execute("DELETE FROM reservations WHERE id = ANY(?)", (reservations,))
