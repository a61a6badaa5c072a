"""Keys, ledger, usage, budgets and rate limits on a real PostgreSQL (started by the suite: conftest.postgres_server),
shared by several gates as replicas share it: each gate has connections of its own."""

import sys
import threading

import pytest
from economics_helpers import TEST_SHEET, Clock, usage

from carpool.cli import main
from carpool.economics import keys as key_store
from carpool.economics import ledger, shared_admission
from carpool.economics.contract import GateError
from carpool.economics.db import SCHEMA, DatabaseUnusable, check_postgres, expected_columns, open_database
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.economics.reports import usage_summary
from carpool.postgres import connect_postgres, migrations


@pytest.fixture
def gates(postgres_url, prices):
    """Two gates on one database: two replicas."""
    clock = Clock()
    opened = [LedgerGate(postgres_url, prices, clock=clock) for _ in range(2)]
    yield opened
    for gate in opened:
        gate.close()


def new_key(url, **limits):
    conn = open_database(url)
    try:
        return key_store.create_key(conn, "acme", **limits)
    finally:
        conn.close()


def test_migrations_apply_once_and_follow_the_sqlite_schema(postgres_url):
    conn = connect_postgres(postgres_url)
    try:
        versions = [row[0] for row in conn.execute("SELECT version FROM schema_version ORDER BY version")]
        assert versions == [version for version, _, _ in migrations()] and len(versions) >= 2
        again = connect_postgres(postgres_url)  # a second replica starting: nothing left to apply
        assert again.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(versions)
        again.close()
        check_postgres(conn)  # keys and ledger hold exactly SCHEMA's columns, in its order
        assert set(expected_columns()) == {"keys", "ledger", "audit_log"} and "original_prompt_tokens" in SCHEMA
        conn.execute("ALTER TABLE ledger DROP COLUMN constraint_kind")
        with pytest.raises(DatabaseUnusable, match="table ledger is not the one carpool writes"):
            check_postgres(conn)
    finally:
        conn.close()


def test_keys_and_reports_through_the_cli(postgres_url, capsys):
    assert main(["keys", "create", "--tenant", "acme", "--budget", "5", "--db", postgres_url]) == 0
    secret = capsys.readouterr().out.strip()
    assert main(["keys", "list", "--format", "json", "--db", postgres_url]) == 0
    assert '"tenant": "acme"' in capsys.readouterr().out
    conn = open_database(postgres_url)
    key = key_store.find_key(conn, secret)
    conn.close()
    assert key.budget == 5.0 and key.budget_period == "month"
    assert main(["keys", "revoke", key.key_id, "--db", postgres_url]) == 0
    assert capsys.readouterr().out.startswith(f"revoked {key.key_id}")
    assert main(["cost", "report", "--format", "csv", "--db", postgres_url]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("tenant,requests")


def test_a_recorded_request_is_one_ledger_row_and_counts_against_its_budget(gates, postgres_url, prices):
    key, secret = new_key(postgres_url, budget=1.0, budget_period="day")
    first, second = gates
    principal = first.authenticate(secret)
    first.admit(principal, "default", 1200, request_id="req-1")
    first.record(principal, usage(request_id="req-1")).result(timeout=30)
    cost = prices.cost(usage())
    conn = open_database(postgres_url)
    try:
        rows = conn.execute("SELECT request_id, key_id, tenant, cost FROM ledger").fetchall()
        assert [tuple(row) for row in rows] == [("req-1", key.key_id, "acme", pytest.approx(cost))]
        assert conn.execute("SELECT COUNT(*) FROM reservations").fetchone()[0] == 0  # settled with the row
        (summary,) = usage_summary(conn, "tenant")
        assert (summary.group, summary.requests, summary.cost) == ("acme", 1, pytest.approx(cost))
    finally:
        conn.close()
    # the other replica sees that spend at once, and the report through either gate agrees
    assert second.key_spend()[0][1]["day"] == pytest.approx(cost)
    assert second.usage("key")[0].cost == pytest.approx(cost)


def test_two_replicas_racing_for_the_last_of_a_budget_admit_one(gates, postgres_url, prices):
    """Each round a fresh key whose budget holds one request's worst case, not two; both gates admit at the
    same moment. Per-process spend (the SQLite path's) lets both through."""
    estimate = prices.worst_case_cost("default", 1000)
    for round_number in range(10):
        _key, secret = new_key(postgres_url, budget=estimate * 1.5, budget_period="day")
        start = threading.Barrier(2)
        outcomes = [None, None]

        def race(index):
            gate = gates[index]
            principal = gate.authenticate(secret)
            start.wait()
            try:
                gate.admit(principal, "default", 1000, request_id=f"r{round_number}-{index}")
                outcomes[index] = "admitted"
            except GateError as refused:
                outcomes[index] = (refused.status, refused.code)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes, key=str) == sorted(["admitted", (429, "insufficient_quota")], key=str), outcomes


def test_spend_settles_the_reservation_and_the_budget_ends_for_every_replica(gates, postgres_url, prices):
    first, second = gates
    cost = prices.cost(usage())
    _key, secret = new_key(postgres_url, budget=cost * 2.5, budget_period="day")
    for request_id, gate in (("a", first), ("b", second)):
        principal = gate.authenticate(secret)
        gate.admit(principal, "default", 100, request_id=request_id)
        gate.record(principal, usage(request_id=request_id)).result(timeout=30)
    second.admit(second.authenticate(secret), "default", 10, request_id="c")  # $0.5 of a request left: admitted
    second.record(second.authenticate(secret), usage(request_id="c")).result(timeout=30)
    for gate in gates:  # 3 requests' cost > budget: refused everywhere
        with pytest.raises(GateError) as refused:
            gate.admit(gate.authenticate(secret), "default", 10, request_id="d")
        assert refused.value.code == "insufficient_quota" and "has spent" in refused.value.message
    assert first.key_spend()[0][1]["month"] == pytest.approx(3 * cost)


def test_a_request_whose_worst_case_exceeds_what_is_left_is_refused(gates, postgres_url, prices):
    _key, secret = new_key(postgres_url, budget=prices.worst_case_cost("default", 1000), budget_period="month")
    gate = gates[0]
    with pytest.raises(GateError) as refused:
        gate.admit(gate.authenticate(secret), "default", 1001, request_id="big")
    assert refused.value.status == 429 and "lower max_tokens" in refused.value.message
    gate.admit(gate.authenticate(secret), "default", 1000, request_id="fits")


def test_the_worst_case_is_priced_on_the_served_models(tmp_path):
    sheet = tmp_path / "prices.toml"
    sheet.write_text(TEST_SHEET + '[models."dear-model"]\ninput = 10.0\noutput = 40.0\n')
    prices = load_price_sheet(sheet)
    assert prices.worst_case_cost("default", 1000, ("test-model",)) == pytest.approx(1000 * 4.0 / 1e6)
    assert prices.worst_case_cost("priority", 1000) == pytest.approx(1000 * 40.0 / 1e6 * 2)  # any model


def test_a_dead_replicas_reservations_lapse(monkeypatch, postgres_url, prices):
    monkeypatch.setattr(shared_admission, "LEASE_SECONDS", 0.5)
    _key, secret = new_key(postgres_url, budget=prices.worst_case_cost("default", 1000), budget_period="day")
    dead, alive = (LedgerGate(postgres_url, prices) for _ in range(2))
    try:
        dead.admit(dead.authenticate(secret), "default", 1000, request_id="never-recorded")
        dead.close()  # stops renewing, as a killed replica does
        with pytest.raises(GateError):
            alive.admit(alive.authenticate(secret), "default", 1000, request_id="x")
        threading.Event().wait(0.6)
        alive.admit(alive.authenticate(secret), "default", 1000, request_id="x")
    finally:
        alive.close()


def test_a_rate_limit_holds_across_replicas(gates, postgres_url):
    _key, secret = new_key(postgres_url, rpm=3)
    first, second = gates
    for gate in (first, second, first):
        gate.admit(gate.authenticate(secret), "default", 10, request_id=None)
    for gate in gates:
        with pytest.raises(GateError) as limited:
            gate.admit(gate.authenticate(secret), "default", 10)
        assert limited.value.code == "rate_limit_exceeded" and 0 < limited.value.retry_after <= 60
    first.clock.now += 61  # the window slides on for both
    second.admit(second.authenticate(secret), "default", 10)


def test_revoking_a_key_acts_on_every_replica(gates, postgres_url):
    key, secret = new_key(postgres_url)
    principals = [gate.authenticate(secret) for gate in gates]
    conn = open_database(postgres_url)
    key_store.revoke_key(conn, key.key_id)
    conn.close()
    for gate, principal in zip(gates, principals, strict=True):
        with pytest.raises(GateError) as revoked:
            gate.admit(principal, "default", 10)
        assert revoked.value.status == 401


def test_a_gate_heals_after_the_database_drops_its_sessions(monkeypatch, gates, postgres_url):
    """A PostgreSQL restart or failover ends every session; the gate's connections open new ones by themselves."""
    monkeypatch.setattr(ledger, "RETRY_SECONDS", 0.05)
    _key, secret = new_key(postgres_url, budget=1.0, budget_period="day", rpm=100)
    gate = gates[0]
    gate.record(gate.authenticate(secret), usage(request_id="before")).result(timeout=30)
    killer = open_database(postgres_url)
    others = "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    killer.execute(f"SELECT pg_terminate_backend(pid) {others}")
    while killer.execute(f"SELECT COUNT(*) {others}").fetchone()[0]:  # until every session has gone
        threading.Event().wait(0.01)
    killer.close()
    outcomes = []
    for attempt in range(3):
        try:
            principal = gate.authenticate(secret)
            gate.admit(principal, "default", 10, request_id=f"after-{attempt}")
            gate.record(principal, usage(request_id=f"after-{attempt}")).result(timeout=30)
            outcomes.append("ok")
        except Exception as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    assert outcomes == ["ok"] * 3 and gate.health() is None, outcomes
    conn = open_database(postgres_url)
    assert conn.execute("SELECT COUNT(*) FROM ledger WHERE request_id = 'after-2'").fetchone()[0] == 1
    conn.close()


def test_an_unreachable_database_is_one_line_naming_it_without_its_password(postgres_server, prices):
    url = f"postgresql://carpool:s3cret@127.0.0.1:{postgres_server.port}/no_such_database"
    with pytest.raises(DatabaseUnusable) as unusable:
        LedgerGate(url, prices)
    message = str(unusable.value)
    assert message.startswith("postgresql://carpool:***@127.0.0.1:") and "s3cret" not in message
    assert "\n" not in message and "no_such_database" in message


def test_without_the_driver_a_postgres_url_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # what an install without `make scale` has
    with pytest.raises(DatabaseUnusable, match="needs psycopg 3.*make scale"):
        open_database("postgresql://carpool@127.0.0.1:5432/carpool")


def test_audit_rows_and_scopes_on_postgres(gates, postgres_url):
    key, secret = new_key(postgres_url, scopes=["files:read-all"])
    gate = gates[0]
    reader = gate.authenticate(secret)
    assert reader.scopes == {"files:read-all"}
    gate.audit(reader, "files.content", "file-abc", "globex")
    conn = open_database(postgres_url)
    try:
        row = conn.execute("SELECT key_id, action, target, owner FROM audit_log").fetchone()
        assert tuple(row) == (key.key_id, "files.content", "file-abc", "globex")
    finally:
        conn.close()
