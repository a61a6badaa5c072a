import sqlite3

import pytest
from economics_helpers import TEST_SHEET, usage
from prometheus_client import CollectorRegistry, generate_latest

from carpool.economics.contract import SCOPES, GateError
from carpool.economics.db import connect
from carpool.economics.keys import create_key, revoke_key, set_budget
from carpool.economics.ledger_gate import LedgerGate, open_ledger_gate
from carpool.economics.prices import PriceSheetError


def new_key(db_path, **kwargs):
    with connect(db_path) as conn:
        return create_key(conn, kwargs.pop("tenant", "acme"), **kwargs)


def ledger_rows(db_path):
    conn = sqlite3.connect(db_path)
    conn.row_factory = sqlite3.Row
    return conn.execute("SELECT * FROM ledger ORDER BY id").fetchall()


def test_open_without_keys_and_records_anonymous_usage(gate, db_path):
    principal = gate.authenticate(None)
    assert principal.key_id is None and principal.scopes == frozenset(SCOPES)
    gate.admit(principal, "priority", 10**9)
    gate.record(principal, usage())
    gate.flush()
    (row,) = ledger_rows(db_path)
    assert row["key_id"] is None and row["cost"] == pytest.approx(0.0018)


def test_wrong_missing_and_revoked_keys_get_401(gate, db_path):
    key, secret = new_key(db_path)
    assert gate.authenticate(secret).key_id == key.key_id
    for attempt in (None, "", "sk-cp-wrong"):
        with pytest.raises(GateError) as raised:
            gate.authenticate(attempt)
        assert (raised.value.status, raised.value.code) == (401, "invalid_api_key")
    with connect(db_path) as conn:
        revoke_key(conn, key.key_id)
    with pytest.raises(GateError) as raised:
        gate.authenticate(secret)
    assert (raised.value.status, raised.value.code) == (401, "invalid_api_key")


def test_principal_carries_tenant_tiers_and_admin(gate, db_path):
    _, secret = new_key(db_path, tenant="ops", scopes=["usage:read"], allowed_tiers=["batch"])
    principal = gate.authenticate(secret)
    assert (principal.tenant, principal.scopes, principal.allowed_tiers) == (
        "ops",
        frozenset({"usage:read"}),
        frozenset({"batch"}),
    )
    gate.admit(principal, "batch", 10)
    with pytest.raises(GateError) as raised:
        gate.admit(principal, "priority", 10)
    assert (raised.value.status, raised.value.code) == (403, "tier_not_allowed")


def test_admission_reserves_each_request_worst_case_until_its_row_settles_the_real_cost(gate, db_path):
    # $0.01 a day. 1200 tokens at the dearest rate (output, $4 per 1M) may cost $0.0048; a finished request below
    # costs $0.0018.
    key, secret = new_key(db_path, budget=0.01, budget_period="day")
    principal = gate.authenticate(secret)

    def refused(request_id, tokens=1200) -> GateError:
        with pytest.raises(GateError) as raised:
            gate.admit(principal, "default", tokens, request_id=request_id)
        assert (raised.value.status, raised.value.code) == (429, "insufficient_quota")
        return raised.value

    gate.admit(principal, "default", 1200, request_id="r1")
    gate.admit(principal, "default", 1200, request_id="r2")  # $0.0096 reserved of $0.01
    too_much = refused("r3")
    assert too_much.param == "max_tokens" and "up to $0.0048" in too_much.message and "$0.0004 left" in too_much.message
    gate.record(principal, usage(request_id="r1"))  # $0.0018 spent, $0.0048 still reserved for r2
    refused("r3")
    gate.record(principal, usage(request_id="r2"))  # $0.0036 spent, nothing reserved
    gate.admit(principal, "default", 1200, request_id="r3")
    gate.record(principal, usage(request_id="r3"))  # $0.0054 spent
    refused("r4")  # its worst case would pass the budget
    gate.admit(principal, "default", 500, request_id="r4")  # a smaller max_tokens fits ($0.002)
    gate.record(principal, usage(request_id="r4"))  # $0.0072 spent
    with connect(db_path) as conn:
        set_budget(conn, key.key_id, 0.007, "day")
    spent = refused("r5", tokens=1)
    assert spent.param is None and spent.message.startswith("This key has spent $0.0072 of its budget of $0.007 per")
    gate.flush()
    assert [row["cost"] for row in ledger_rows(db_path)] == pytest.approx([0.0018] * 4)
    assert gate._admission.reserved(key.key_id) == 0
    # Raising the budget on the running server lets the key in again at its next request.
    with connect(db_path) as conn:
        set_budget(conn, key.key_id, 1.0, "day")
    gate.admit(gate.authenticate(secret), "default", 1200)


def test_a_reservation_is_released_by_an_aborted_or_withheld_row(gate, db_path):
    key, secret = new_key(db_path, budget=0.01, budget_period="day")
    principal = gate.authenticate(secret)
    gate.admit(principal, "default", 1200, request_id="aborted")
    gate.admit(principal, "default", 1200, request_id="withheld")
    assert gate._admission.reserved(key.key_id) == pytest.approx(0.0096)
    gate.record(principal, usage(request_id="aborted", output=0, finish_reason="abort")).result(timeout=10)
    gate.record(principal, usage(request_id="withheld", finish_reason="withheld")).result(timeout=10)
    assert gate._admission.reserved(key.key_id) == 0
    assert [(row["finish_reason"], row["cost"]) for row in ledger_rows(db_path)] == [
        ("abort", pytest.approx(0.001)),
        ("withheld", 0.0),
    ]


def test_daily_budget_resets_at_utc_midnight_and_monthly_does_not(db_path, prices, clock):
    _, daily = new_key(db_path, budget=0.001, budget_period="day")
    _, monthly = new_key(db_path, budget=0.001, budget_period="month")
    clock.now = 1_750_032_000.0 - 60  # 2025-06-16 00:00 UTC, less a minute
    gate = LedgerGate(db_path, prices, clock=clock)
    try:
        for secret in (daily, monthly):
            principal = gate.authenticate(secret)
            gate.record(principal, usage(created=clock.now))
            with pytest.raises(GateError):
                gate.admit(principal, "default", 1)
        clock.now += 120  # the next day, same month
        gate.admit(gate.authenticate(daily), "default", 1)
        with pytest.raises(GateError, match="per month"):
            gate.admit(gate.authenticate(monthly), "default", 1)
    finally:
        gate.close()


def test_spend_survives_a_restart(db_path, prices, clock):
    _, secret = new_key(db_path, budget=0.001, budget_period="month")
    first = LedgerGate(db_path, prices, clock=clock)
    first.record(first.authenticate(secret), usage(created=clock.now))
    first.close()
    second = LedgerGate(db_path, prices, clock=clock)
    try:
        with pytest.raises(GateError) as raised:
            second.admit(second.authenticate(secret), "default", 1)
        assert raised.value.code == "insufficient_quota"
    finally:
        second.close()


def test_rate_limits_answer_429_with_retry_after(gate, db_path, clock):
    _, secret = new_key(db_path, rpm=2, tpm=1000)
    principal = gate.authenticate(secret)
    gate.admit(principal, "default", 300)
    clock.now += 10
    gate.admit(principal, "default", 300)
    clock.now += 5
    with pytest.raises(GateError) as raised:
        gate.admit(principal, "default", 100)
    error = raised.value
    assert (error.status, error.code) == (429, "rate_limit_exceeded")
    assert error.retry_after == pytest.approx(45)  # the first admission leaves the window 60 s after it came
    clock.now += 45
    gate.admit(principal, "default", 100)


def test_record_fills_key_and_tenant_from_principal_and_counts_cost(gate, db_path):
    registry = CollectorRegistry()
    gate.register_metrics(registry, per_tenant=True)
    key, secret = new_key(db_path, tenant="acme")
    principal = gate.authenticate(secret)
    gate.record(principal, usage(tier="priority"))
    gate.record(principal, usage(tier="priority", output=50, finish_reason="abort"))
    gate.record(gate.authenticate(secret), usage(tier="batch"))
    gate.flush()
    rows = ledger_rows(db_path)
    assert {(row["key_id"], row["tenant"]) for row in rows} == {(key.key_id, "acme")}
    assert registry.get_sample_value("carpool:cost_total", {"tenant": "acme", "tier": "priority"}) == pytest.approx(
        0.006
    )
    assert registry.get_sample_value("carpool:cost_total", {"tenant": "acme", "tier": "batch"}) == pytest.approx(0.0009)


def test_metrics_show_no_tenant_unless_asked(gate, db_path):
    """/metrics needs no key: by default it shows spend by tier only, never who spent it."""
    registry = CollectorRegistry()
    gate.register_metrics(registry)
    _, secret = new_key(db_path, tenant="acme-secret-project")
    record = usage(tier="priority")
    gate.record(gate.authenticate(secret), record)
    assert gate.flush(timeout=30)
    assert registry.get_sample_value("carpool:cost_total", {"tier": "priority"}) == pytest.approx(
        gate.prices.cost(record)
    )
    assert registry.get_sample_value("carpool:ledger_healthy") == 1
    assert "acme-secret-project" not in generate_latest(registry).decode()


def test_ledger_row_has_every_issue_field(gate, db_path):
    gate.record(
        gate.authenticate(None),
        usage(cached=400, cache_write=300, output=50, finish_reason="abort", tier="flex", request_id="req"),
    )
    gate.flush()
    (row,) = ledger_rows(db_path)
    assert dict(row) | {"id": None, "time": None} == {
        "id": None,
        "time": None,
        "request_id": "req",
        "key_id": None,
        "tenant": None,
        "model": "test-model",
        "tier": "flex",
        "uncached_prompt_tokens": 600,
        "cache_read_tokens": 400,
        "cache_write_tokens": 300,
        "output_tokens": 50,
        "queue_seconds": 0.01,
        "prefill_seconds": 0.2,
        "decode_seconds": 0.8,
        "finish_reason": "abort",
        "cost": pytest.approx(0.0004575),
        "purpose": "request",
        "parent_request_id": None,
        "cascade": None,
        "cascade_step": None,
        "cascade_accepted": None,
        "constraint_kind": None,
        "original_prompt_tokens": None,
        "cache_write_5m_tokens": 0,
        "cache_write_1h_tokens": 0,
        "arrived": None,  # a record made outside a server's Generation: no arrival, no prompt to hash
        "prompt_block_chain": None,
    }


def test_open_ledger_gate_checks_the_sheet_covers_the_served_model(tmp_path):
    sheet = tmp_path / "prices.toml"
    sheet.write_text(TEST_SHEET)
    with pytest.raises(PriceSheetError, match='no entry models."other" for the served model'):
        open_ledger_gate(tmp_path / "a.db", sheet, served_models=("other",))
    open_ledger_gate(tmp_path / "a.db", sheet, served_models=("test-model",)).close()
    open_ledger_gate(tmp_path / "a.db", None, served_models=("anything",)).close()  # the shipped "*" entry
    sheet.write_text("[tiers")
    with pytest.raises(PriceSheetError, match="not valid TOML"):
        open_ledger_gate(tmp_path / "a.db", sheet)


def test_a_read_of_another_tenants_file_is_on_the_audit_log(gate, db_path):
    _, secret = new_key(db_path, tenant="audit", scopes=["files:read-all"])
    reader = gate.authenticate(secret)
    gate.audit(reader, "files.content", "file-abc", "acme")
    conn = sqlite3.connect(db_path)
    (row,) = conn.execute("SELECT key_id, tenant, action, target, owner, time FROM audit_log").fetchall()
    assert row[:5] == (reader.key_id, "audit", "files.content", "file-abc", "acme") and row[5] == gate.clock()
