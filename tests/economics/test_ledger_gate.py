import sqlite3

import pytest
from economics_helpers import TEST_SHEET, usage
from prometheus_client import CollectorRegistry, generate_latest

from carpool.economics.contract import GateError
from carpool.economics.db import connect
from carpool.economics.gate import LedgerGate, open_ledger_gate
from carpool.economics.keys import create_key, revoke_key, set_budget
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
    assert principal.key_id is None and principal.is_admin
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
    _, secret = new_key(db_path, tenant="ops", is_admin=True, allowed_tiers=["batch"])
    principal = gate.authenticate(secret)
    assert (principal.tenant, principal.is_admin, principal.allowed_tiers) == ("ops", True, frozenset({"batch"}))
    gate.admit(principal, "batch", 10)
    with pytest.raises(GateError) as raised:
        gate.admit(principal, "priority", 10)
    assert (raised.value.status, raised.value.code) == (403, "tier_not_allowed")


def test_budget_exhaustion_refuses_the_next_request_but_not_the_running_one(gate, db_path):
    # $0.003 a day; each finished default-tier request below costs $0.0018.
    key, secret = new_key(db_path, budget=0.003, budget_period="day")
    principal = gate.authenticate(secret)
    gate.admit(principal, "default", 1200)  # first request: admitted
    gate.admit(principal, "default", 1200)  # second, admitted while the first runs
    gate.record(principal, usage())  # first finishes: $0.0018 spent
    gate.admit(principal, "default", 1200)  # under budget still: admitted
    gate.record(principal, usage())  # second finishes: $0.0036, over budget; still billed in full
    with pytest.raises(GateError) as raised:
        gate.admit(principal, "default", 1200)
    assert (raised.value.status, raised.value.code) == (429, "insufficient_quota")
    gate.record(principal, usage())  # the third, admitted before the budget ran out, finishes and is billed
    gate.flush()
    assert [row["cost"] for row in ledger_rows(db_path)] == pytest.approx([0.0018] * 3)
    # Raising the budget on the running server lets the key in again at its next request.
    with connect(db_path) as conn:
        set_budget(conn, key.key_id, 1.0, "day")
    gate.admit(gate.authenticate(secret), "default", 1200)


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
        gate.authenticate(None), usage(cached=400, cache_write=300, output=50, finish_reason="abort", tier="flex")
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
