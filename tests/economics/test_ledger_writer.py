import sqlite3
import threading
import time

import pytest
from economics_helpers import usage
from ledger_faults import fill_disk
from prometheus_client import CollectorRegistry

from carpool.economics.contract import GateError
from carpool.economics.db import connect
from carpool.economics.keys import create_key
from carpool.economics.ledger_gate import LedgerGate

CLIENTS = 50
REQUESTS_PER_CLIENT = 40


def test_50_concurrent_clients_lose_no_row_and_sums_match_the_counters(gate, db_path):
    registry = CollectorRegistry()
    gate.register_metrics(registry)
    with connect(db_path) as conn:
        secrets = [create_key(conn, f"tenant-{i % 5}")[1] for i in range(CLIENTS)]
    counted = {"prompt": 0, "cached": 0, "output": 0}  # what the server's own token counters would hold
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client(n: int) -> None:
        principal = gate.authenticate(secrets[n])
        start.wait()
        for i in range(REQUESTS_PER_CLIENT):
            record = usage(
                prompt=100 + n,
                cached=(i % 3) * 16,
                cache_write=16,
                output=i + 1,
                tier=("priority", "default", "flex", "batch")[i % 4],
                request_id=f"{n}-{i}",
            )
            gate.admit(principal, record.tier, record.prompt_tokens + record.output_tokens)
            gate.record(principal, record)
            with lock:
                counted["prompt"] += record.prompt_tokens
                counted["cached"] += record.cached_tokens
                counted["output"] += record.output_tokens

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert gate.flush(timeout=30)

    conn = sqlite3.connect(db_path)
    rows, distinct, uncached, cached, output, cost = conn.execute(
        "SELECT COUNT(*), COUNT(DISTINCT request_id), SUM(uncached_prompt_tokens), SUM(cache_read_tokens),"
        " SUM(output_tokens), SUM(cost) FROM ledger"
    ).fetchone()
    assert rows == distinct == CLIENTS * REQUESTS_PER_CLIENT
    assert (uncached + cached, cached, output) == (counted["prompt"], counted["cached"], counted["output"])
    metric_cost = sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "carpool:cost_total"
    )
    assert metric_cost == pytest.approx(cost, rel=1e-9)


def test_record_does_not_wait_for_a_locked_database(gate, db_path):
    blocker = sqlite3.connect(db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # holds the write lock, as a long report export or backup might
    principal = gate.authenticate(None)
    started = time.perf_counter()
    for i in range(100):
        gate.record(principal, usage(request_id=str(i)))
    elapsed = time.perf_counter() - started
    assert not gate.flush(timeout=0.2)  # the writer is stuck behind the lock...
    blocker.execute("COMMIT")
    assert gate.flush(timeout=30)  # ...and catches up once it is released
    # A record() that wrote itself would wait out the connection's 30 s busy timeout on the first row; 5 s leaves
    # a loaded CI machine room for 100 queue puts.
    assert elapsed < 5, f"record() took {elapsed:.3f} s for 100 rows while the database was locked"
    assert sqlite3.connect(db_path).execute("SELECT COUNT(*) FROM ledger").fetchone()[0] == 100


def test_close_commits_what_is_queued(db_path, prices):
    gate = LedgerGate(db_path, prices)
    for i in range(20):
        gate.record(gate.authenticate(None), usage(request_id=str(i)))
    gate.close()
    assert sqlite3.connect(db_path).execute("SELECT COUNT(*) FROM ledger").fetchone()[0] == 20


def test_record_resolves_only_once_the_row_is_committed(gate, db_path):
    """The server holds a response's last byte on this Future: it must not resolve before the commit."""
    blocker = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")  # the writer cannot commit until this lets go
    durable = gate.record(gate.authenticate(None), usage(request_id="held"))
    time.sleep(0.2)
    assert not durable.done()
    blocker.execute("COMMIT")
    assert durable.result(timeout=30) is None
    assert sqlite3.connect(db_path).execute("SELECT request_id FROM ledger").fetchall() == [("held",)]


def test_a_ledger_that_cannot_write_refuses_billable_work_until_it_can(monkeypatch, db_path, prices):
    full_disk = fill_disk(monkeypatch)
    gate = LedgerGate(db_path, prices)
    try:
        registry = CollectorRegistry()
        gate.register_metrics(registry)
        principal = gate.authenticate(None)
        gate.admit(principal, "default", 10)
        with pytest.raises(GateError) as withheld:  # the request ran, but its client must not hear "success"
            gate.record(principal, usage(request_id="ran")).result(timeout=30)
        assert (withheld.value.status, withheld.value.code) == (503, "ledger_unavailable")
        assert "database or disk is full" in withheld.value.message
        assert "database or disk is full" in gate.health()
        assert registry.get_sample_value("carpool:ledger_healthy") == 0
        with pytest.raises(GateError) as refused:
            gate.admit(principal, "default", 10)
        assert (refused.value.status, refused.value.code) == (503, "ledger_unavailable")
        assert refused.value.retry_after is not None

        full_disk.full = False  # space again: the next retry writes the held row and admission reopens
        deadline = time.monotonic() + 30
        while gate.health() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gate.health() is None and registry.get_sample_value("carpool:ledger_healthy") == 1
        gate.admit(principal, "default", 10)
        # the client never got the result: the row records the compute but bills nothing, and the spend it
        # counted at record time is refunded, so a retry of the same request is billed once
        rows = sqlite3.connect(db_path).execute("SELECT request_id, finish_reason, cost FROM ledger").fetchall()
        assert rows == [("ran", "withheld", 0.0)]
        assert gate._admission.spent(principal.key_id, "day", time.time()) == 0
        assert (registry.get_sample_value("carpool:cost_total", {"tier": "default"}) or 0) == 0
        gate.record(principal, usage(request_id="retried")).result(timeout=30)
        retried = sqlite3.connect(db_path).execute("SELECT cost FROM ledger WHERE request_id = 'retried'").fetchone()
        assert retried[0] > 0 and gate._admission.spent(principal.key_id, "day", time.time()) == retried[0]
    finally:
        gate.close()


def test_a_writer_that_dies_fails_what_waits_and_refuses_new_rows(gate):
    """No response may hang on a row nobody will commit, and a dead ledger admits no billable work."""

    def broken(conn, rows):
        raise RuntimeError("writer bug")

    gate._writer._commit = broken  # read by the writer thread at its next commit
    for request_id in ("waiting", "after"):  # queued when the writer died; submitted after it
        with pytest.raises(GateError) as withheld:
            gate.record(gate.authenticate(None), usage(request_id=request_id)).result(timeout=30)
        assert withheld.value.status == 503 and "writer stopped" in withheld.value.message
    with pytest.raises(GateError) as refused:
        gate.admit(gate.authenticate(None), "default", 10)
    assert refused.value.status == 503
