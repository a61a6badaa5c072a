"""LedgerGate: the server's Gate backed by the economics database: keys, budgets, rate limits, ledger, prices.

Admission is the only point of enforcement: a request that got in runs to the end, whatever its tenant spends
meanwhile. Admission reads the key as it stands now, so a batch line is held to its key's current state
(revoked, new limits, budget spent), even after a restart; and everything billable is refused while the ledger
cannot write.

Where budgets and rate limits live depends on the database. A SQLite file has one server: spend, reservations
and rate windows are kept in its memory (LocalAdmission). A PostgreSQL database may have many replicas: they live
in the database (SharedAdmission). Either way each admitted request reserves its worst-case cost until its row
settles the real one (carpool/economics/budget.py), so requests admitted together never overshoot a budget.
"""

import contextlib
import dataclasses
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from carpool.economics.budget import check_budget
from carpool.economics.contract import SCOPES, WITHHELD, GateError, Principal, UsageRecord
from carpool.economics.db import check_any_database, default_db_path, is_postgres_url, open_database
from carpool.economics.keys import ANONYMOUS, ApiKey, find_key, has_keys, list_keys, lookup_key
from carpool.economics.ledger import RETRY_SECONDS, DuplicateRequestId, LedgerWriter
from carpool.economics.prices import PriceSheet, PriceSheetError, load_price_sheet
from carpool.economics.rate_limit import RateLimiter, RateLimitExceeded
from carpool.economics.reports import CascadeSummary, UsageSummary, cascade_summary, usage_summary
from carpool.economics.spend import PERIODS, SpendTracker


class LocalAdmission:
    """Budgets and rate limits of the one server a SQLite database has, kept in its memory: spend recorded so far
    (SpendTracker) and what admitted requests may still cost, reserved until their rows are recorded."""

    def __init__(self, conn, now: float):
        self._spend = SpendTracker(conn, now)
        self._limiter = RateLimiter()
        self._lock = threading.Lock()  # admission is check-then-reserve: one at a time, whichever thread admits
        self._reserved: dict[str, float] = {}  # key id -> the worst cases of its requests in flight
        self._in_flight: dict[str, int] = {}  # key id -> how many reservations that is
        # request id -> (key id, amount) of each reservation made under that id: a client may send one id twice
        self._reservations: dict[str, list[tuple[str, float]]] = {}

    def admit(
        self, key: ApiKey, estimated_tokens: int, estimated_cost: float, request_id: str | None, now: float
    ) -> None:
        with self._lock:
            if key.budget is not None:
                spent = self._spend.spent(key.key_id, key.budget_period, now)
                check_budget(key, spent, self._reserved.get(key.key_id, 0.0), estimated_cost)
            try:
                self._limiter.admit(key.key_id, estimated_tokens, key.rpm, key.tpm, now)
            except RateLimitExceeded as limited:
                raise GateError(429, limited.message, "rate_limit_exceeded", retry_after=limited.retry_after) from None
            if key.budget is not None and request_id is not None:
                self._reserved[key.key_id] = self._reserved.get(key.key_id, 0.0) + estimated_cost
                self._in_flight[key.key_id] = self._in_flight.get(key.key_id, 0) + 1
                self._reservations.setdefault(request_id, []).append((key.key_id, estimated_cost))

    def recorded(self, usage: UsageRecord, cost: float) -> None:
        """The cost counted and the request's reservation released in one step, so concurrent admissions see one
        or the other, never neither (nothing is left for the row to settle)."""
        with self._lock:
            self._spend.add(usage.key_id, cost, usage.created)
            held = self._reservations.get(usage.request_id, [])
            for index, (key_id, amount) in enumerate(held):
                if key_id == usage.key_id:
                    del held[index]
                    self._reserved[key_id] -= amount
                    self._in_flight[key_id] -= 1
                    if not self._in_flight[key_id]:  # exactly nothing, not the float residue of adding and taking
                        del self._reserved[key_id], self._in_flight[key_id]
                    break
            if not held:
                self._reservations.pop(usage.request_id, None)

    def withheld(self, usage: UsageRecord, cost: float) -> None:
        self._spend.add(usage.key_id, -cost, usage.created)

    def reserved(self, key_id: str) -> float:
        with self._lock:
            return self._reserved.get(key_id, 0.0)

    def spent(self, key_id: str | None, period: str, now: float) -> float:
        return self._spend.spent(key_id, period, now)

    def close(self) -> None:
        pass


class LedgerGate:
    def __init__(
        self,
        db_path: str | Path,
        prices: PriceSheet,
        clock: Callable[[], float] = time.time,
        served_models: tuple[str, ...] = (),
    ):
        """`db_path`: a SQLite file, or a PostgreSQL URL shared by several replicas. `served_models`: what a
        request may run on, priced for its worst case at admission (default: any model on the sheet)."""
        self.db_path = db_path
        self.prices = prices
        self.served_models = served_models
        self.clock = clock
        # Key lookups run on the server's threads; one connection behind a lock is enough for an indexed read.
        self._conn = open_database(db_path)
        check_any_database(self._conn, db_path)
        self._conn_lock = threading.Lock()
        # A PostgreSQL gate's key lookups and admission are round trips to a database server: the server runs them
        # off its event loop (Serving.started), and a database it cannot reach is a retryable 503, not a 500.
        self.admits_remotely = is_postgres_url(db_path)
        if is_postgres_url(db_path):
            from carpool.economics.shared_admission import SharedAdmission, settle

            self._admission = SharedAdmission(db_path)
            self._writer = LedgerWriter(db_path, settle=settle)
        else:
            self._admission = LocalAdmission(self._conn, clock())
            self._writer = LedgerWriter(db_path)
        self._cost_counter: Counter | None = None
        self._cost_by_tenant = False

    # The Gate protocol ----------------------------------------------------------------------------------

    def authenticate(self, api_key: str | None) -> Principal:
        """Looked up on every request, so `carpool keys revoke` and `set-budget` act on a running server."""
        with self._database(), self._conn_lock:
            if not has_keys(self._conn):  # no keys configured: the server stays open, reports included
                return Principal(scopes=frozenset(SCOPES))
            key = find_key(self._conn, api_key) if api_key else None
        if key is None or key.revoked is not None:
            raise GateError(401, "Incorrect, revoked or missing API key.", "invalid_api_key")
        return Principal(key_id=key.key_id, tenant=key.tenant, allowed_tiers=key.allowed_tiers, scopes=key.scopes)

    def admit(
        self,
        principal: Principal,
        tier: str,
        estimated_tokens: int,
        request_id: str | None = None,
        model: str | None = None,
    ) -> None:
        if self._writer.problem is not None:
            raise GateError(
                503,
                f"Billable requests are refused while {self._writer.problem}.",
                "ledger_unavailable",
                retry_after=RETRY_SECONDS,
            )
        key = self._current_key(principal.key_id)
        if key is None:
            return  # no keys configured: the server is open
        if key.allowed_tiers is not None and tier not in key.allowed_tiers:
            raise GateError(403, f"service_tier {tier!r} is not allowed for this key", "tier_not_allowed")
        # The model it runs on, when the gate is told and the sheet prices it; else the dearest it could run on.
        models = (model,) if model is not None and self.prices.covers(model) else self.served_models
        estimated_cost = self.prices.worst_case_cost(tier, estimated_tokens, models)
        self._admission.admit(key, estimated_tokens, estimated_cost, request_id, self.clock())

    def _current_key(self, key_id: str | None) -> ApiKey | None:
        """The principal's key as the database has it now (one indexed read): a batch line runs long after its
        batch was made, possibly in another process, with the key revoked or its limits changed since."""
        if key_id is None:
            return None
        with self._database(), self._conn_lock:
            key = lookup_key(self._conn, key_id)
        if key is None or key.revoked is not None:
            raise GateError(401, "This API key was revoked.", "invalid_api_key")
        return key

    def _database(self):
        """Around a statement: a PostgreSQL database that cannot be reached is a retryable 503."""
        if not self.admits_remotely:
            return contextlib.nullcontext()
        from carpool.economics.shared_admission import database_unavailable

        return database_unavailable()

    def record(self, principal: Principal, usage: UsageRecord) -> Future:
        """Price the request, count it against its key's budget now, and queue its ledger row. Never waits; the
        Future resolves once the row is committed, or fails with the 503 to answer instead."""
        usage = dataclasses.replace(
            usage, key_id=usage.key_id or principal.key_id, tenant=usage.tenant or principal.tenant
        )
        cost = 0.0 if usage.finish_reason == WITHHELD else self.prices.cost(usage)
        reservation = self._admission.recorded(usage, cost)
        durable: Future = Future()

        def settle(written: Future) -> None:
            if written.exception() is None:
                if self._cost_counter is not None:
                    tenant = {"tenant": usage.tenant or ANONYMOUS} if self._cost_by_tenant else {}
                    self._cost_counter.labels(tier=usage.tier, **tenant).inc(cost)
                durable.set_result(None)
            else:  # the client is told why, not the result: the ledger writes the row at no cost, so refund it
                self._admission.withheld(usage, cost)
                durable.set_exception(_withheld_error(written.exception()))

        self._writer.submit(usage, cost, reservation).add_done_callback(settle)
        return durable

    def health(self) -> str | None:
        return self._writer.problem

    def audit(self, principal: Principal, action: str, target: str, owner: str | None) -> None:
        """Committed before it returns: a read that cannot be put on the record does not happen (503)."""
        try:
            with self._database(), self._conn_lock, self._conn:
                self._conn.execute(
                    "INSERT INTO audit_log (time, key_id, tenant, action, target, owner) VALUES (?, ?, ?, ?, ?, ?)",
                    (self.clock(), principal.key_id, principal.tenant, action, target, owner),
                )
        except sqlite3.Error as error:
            raise GateError(
                503, f"The read could not be recorded in the audit log ({error}); retry shortly.", "audit_unavailable"
            ) from None

    # For the server -------------------------------------------------------------------------------------

    def register_metrics(self, registry: CollectorRegistry, per_tenant: bool = False) -> Counter:
        """Export `carpool:cost` (dollars by tier, and by tenant too when `per_tenant`: /metrics needs no key,
        so tenant names and spend are shown only when asked for) and `carpool:ledger_healthy` in `registry`."""
        self._cost_by_tenant = per_tenant
        labels = ["tenant", "tier"] if per_tenant else ["tier"]
        self._cost_counter = Counter(
            "carpool:cost", "Dollars charged, by service tier (and tenant, if enabled)", labels, registry=registry
        )
        healthy = Gauge(
            "carpool:ledger_healthy",
            "1 while the usage ledger can write; 0 while it cannot (billable requests are refused)",
            registry=registry,
        )
        healthy.set_function(lambda: float(self._writer.problem is None))
        return self._cost_counter

    def key_spend(self) -> list[tuple[ApiKey, dict[str, float]]]:
        """Every key not revoked, with what it spent so far this UTC day and month: the figures admission holds
        budgets to (no ledger query)."""
        now = self.clock()
        with self._conn_lock:
            keys = list_keys(self._conn)
        return [
            (key, {period: self._admission.spent(key.key_id, period, now) for period in PERIODS})
            for key in keys
            if key.revoked is None
        ]

    def usage(self, group_by: str, start: float | None = None, end: float | None = None) -> list[UsageSummary]:
        """The usage report over [start, end), rows recorded so far included."""
        self.flush(timeout=5)
        conn = open_database(self.db_path)
        try:
            return usage_summary(conn, group_by, start, end)
        finally:
            conn.close()

    def cascade_usage(self, start: float | None = None, end: float | None = None) -> list[CascadeSummary]:
        """The cascade report over [start, end) (carpool.economics.reports.cascade_summary)."""
        self.flush(timeout=5)
        conn = open_database(self.db_path)
        try:
            return cascade_summary(conn, self.prices, start, end)
        finally:
            conn.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every recorded request's row is committed."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        self._writer.close()
        self._admission.close()
        with self._conn_lock:
            self._conn.close()


def _withheld_error(error: BaseException) -> GateError:
    """What a client whose result is withheld is answered, given why its row could not be billed."""
    if isinstance(error, DuplicateRequestId):
        return GateError(
            409,
            f"x-request-id {error.request_id!r} names a request already billed; this one ran, but its result is "
            f"withheld and not billed: send each request with an x-request-id of its own.",
            "duplicate_request_id",
        )
    return GateError(
        503, f"The request ran, but {error}; its result is withheld.", "ledger_unavailable", retry_after=RETRY_SECONDS
    )


def open_ledger_gate(
    db_path: str | Path | None = None, prices_path: str | Path | None = None, served_models: tuple[str, ...] = ()
) -> LedgerGate:
    """The gate for `carpool serve`, in one process or as replicas (one function for both): `db_path` a SQLite
    file or a PostgreSQL URL the replicas share. Fails (PriceSheetError, naming the entry) unless the sheet is
    sound and prices every served model, so no request can finish without a price."""
    prices = load_price_sheet(prices_path)
    for model in served_models:
        if not prices.covers(model):
            raise PriceSheetError(f'price sheet {prices.source}: no entry models."{model}" for the served model')
    return LedgerGate(db_path or default_db_path(), prices, served_models=served_models)
