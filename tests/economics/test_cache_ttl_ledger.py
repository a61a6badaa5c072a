"""Prompt-cache TTL writes in the price sheet, the ledger and `carpool cost report`; older sheets and databases."""

import json
import sqlite3
from dataclasses import replace

import pytest
from economics_helpers import TEST_SHEET, usage

from carpool import postgres
from carpool.cli import main
from carpool.economics.db import SCHEMA, check_database, check_postgres, connect
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import PriceSheetError, load_price_sheet


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_an_older_sheet_without_the_ttl_keys_loads_with_their_defaults(prices):
    assert "write_1h" not in TEST_SHEET and "min_tokens" not in TEST_SHEET
    assert (prices.cache_write, prices.cache_write_1h, prices.cache_read, prices.cache_min_tokens) == (
        1.25,
        2.0,
        0.1,
        1024,
    )


def test_the_shipped_sheet_states_the_ttl_prices():
    sheet = load_price_sheet()
    assert (sheet.cache_write, sheet.cache_write_1h, sheet.cache_read, sheet.cache_min_tokens) == (1.25, 2.0, 0.1, 1024)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("write_1h = -1", "cache.write_1h must not be negative"),
        ("min_tokens = 10.5", "cache.min_tokens must be a non-negative integer"),
        ("min_tokens = true", "cache.min_tokens must be a non-negative integer"),
        ("write_2h = 3", "unknown entry cache.write_2h"),
    ],
)
def test_bad_ttl_entries_name_themselves(tmp_path, entry, message):
    path = tmp_path / "prices.toml"
    path.write_text(TEST_SHEET.replace("write = 1.25", f"write = 1.25\n{entry}"))
    with pytest.raises(PriceSheetError, match=message):
        load_price_sheet(path)


def test_ttl_writes_priced_by_ttl_and_tier(prices):
    """Input $1/M: 1000 fresh + 1000 automatic writes (1.25) + 1000 5m (1.25) + 1000 1h (2.0) + 1000 read (0.1)."""
    record = usage(prompt=5000, cached=1000, cache_write=1000, cache_write_5m_tokens=1000, cache_write_1h_tokens=1000)
    expected = (1000 + 1250 + 1250 + 2000 + 100 + 200 * 4.0) / 1e6
    assert prices.cost(record) == pytest.approx(expected, rel=1e-12)
    assert prices.cost(replace(record, tier="batch")) == pytest.approx(expected * 0.5, rel=1e-12)
    assert prices.worst_case_cost("default", 1000) == pytest.approx(1000 * 4.0 / 1e6)  # output is still dearest


def test_the_ledger_and_cost_report_show_writes_by_ttl(capsys, db_path, prices):
    gate = LedgerGate(db_path, prices)
    principal = gate.authenticate(None)
    gate.record(principal, usage(prompt=3000, cache_write_5m_tokens=1000, cache_write_1h_tokens=2000, output=0))
    gate.close()
    row = sqlite3.connect(db_path).execute("SELECT cache_write_5m_tokens, cache_write_1h_tokens, cost FROM ledger")
    assert row.fetchone() == (1000, 2000, pytest.approx((1000 * 1.25 + 2000 * 2.0) / 1e6, rel=1e-12))
    code, out = run(capsys, "cost", "report", "--format", "json", "--db", str(db_path))
    assert code == 0
    (data,) = json.loads(out)["data"]
    assert (data["cache_write_5m_tokens"], data["cache_write_1h_tokens"]) == (1000, 2000)
    code, out = run(capsys, "cost", "report", "--db", str(db_path))
    heading, anonymous = out.splitlines()[:2]
    assert "write_5m" in heading and "write_1h" in heading and " 1000 " in anonymous and " 2000 " in anonymous


def test_a_ledger_from_before_ttls_gains_the_columns_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    ttl_lines = SCHEMA[SCHEMA.index("original_prompt_tokens INTEGER,") : SCHEMA.index("\n);", SCHEMA.index("original"))]
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA.replace(ttl_lines, "original_prompt_tokens INTEGER"))
    assert "cache_write_5m_tokens" not in {row[1] for row in conn.execute("PRAGMA table_info(ledger)")}
    conn.execute(
        "INSERT INTO ledger (time, model, tier, uncached_prompt_tokens, cache_read_tokens, cache_write_tokens,"
        " output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost)"
        " VALUES (1, 'm', 'default', 10, 0, 4, 5, 0, 0, 0, 'stop', 0.5)"
    )
    conn.commit()
    conn.close()
    upgraded = connect(path)
    check_database(upgraded, path)
    (row,) = upgraded.execute("SELECT * FROM ledger").fetchall()
    assert (row["cost"], row["cache_write_tokens"], row["cache_write_5m_tokens"], row["cache_write_1h_tokens"]) == (
        0.5,
        4,
        0,
        0,
    )


def test_a_postgres_ledger_from_before_ttls_migrates_and_bills_writes_by_ttl(monkeypatch, postgres_url, prices):
    """Migration 005 on a database the migrations before it built, holding a row: it keeps the row (0 TTL writes)
    and the ledger then takes rows with TTL writes, as check_postgres holds it to SCHEMA's columns."""
    every = postgres.migrations()
    monkeypatch.setattr(postgres, "migrations", lambda: [m for m in every if m[0] < 5])
    old = postgres.connect_postgres(postgres_url)
    with old:
        old.execute(
            "INSERT INTO ledger (time, model, tier, uncached_prompt_tokens, cache_read_tokens, cache_write_tokens,"
            " output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost)"
            " VALUES (1, 'm', 'default', 10, 0, 4, 5, 0, 0, 0, 'stop', 0.5)"
        )
    old.close()
    monkeypatch.undo()
    conn = postgres.connect_postgres(postgres_url)
    try:
        check_postgres(conn)
        gate = LedgerGate(postgres_url, prices)
        gate.record(gate.authenticate(None), usage(prompt=3000, cache_write_1h_tokens=2000, output=0)).result(30)
        gate.close()
        rows = conn.execute("SELECT cache_write_5m_tokens, cache_write_1h_tokens, cost FROM ledger ORDER BY id")
        assert [tuple(row) for row in rows] == [(0, 0, 0.5), (0, 2000, pytest.approx((1000 + 4000) / 1e6))]
    finally:
        conn.close()
