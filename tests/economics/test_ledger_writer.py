import sqlite3
import threading
import time

import pytest
from economics_helpers import usage
from prometheus_client import CollectorRegistry

from carpool.economics.db import connect
from carpool.economics.gate import LedgerGate
from carpool.economics.keys import create_key

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
    assert elapsed < 0.1, f"record() took {elapsed:.3f} s for 100 rows while the database was locked"
    assert sqlite3.connect(db_path).execute("SELECT COUNT(*) FROM ledger").fetchone()[0] == 100


def test_close_commits_what_is_queued(db_path, prices):
    gate = LedgerGate(db_path, prices)
    for i in range(20):
        gate.record(gate.authenticate(None), usage(request_id=str(i)))
    gate.close()
    assert sqlite3.connect(db_path).execute("SELECT COUNT(*) FROM ledger").fetchone()[0] == 20
