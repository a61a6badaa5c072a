import csv
import io
import json

import pytest
from economics_helpers import usage

from carpool.economics.db import connect
from carpool.economics.keys import create_key
from carpool.economics.reports import parse_time, render, usage_summary

T0 = 1_750_000_000.0


@pytest.fixture
def ledger(gate, db_path):
    """Three tenants' requests, at known times, with known costs (test prices: $1 in, $4 out per 1M)."""
    with connect(db_path) as conn:
        acme, ops = (create_key(conn, tenant)[1] for tenant in ("acme", "ops"))
    acme_p, ops_p = gate.authenticate(acme), gate.authenticate(ops)
    # acme: 1000 uncached in + 200 out, default ($0.0018), and 600 uncached + 400 cached in + 50 out, priority
    # (600 + 40 + 200 = 840 -> x2 = $0.00168); prefill 0.2 s and decode 0.8 s each.
    gate.record(acme_p, usage(created=T0, model="test-model"))
    gate.record(acme_p, usage(created=T0 + 10, cached=400, output=50, tier="priority", finish_reason="abort"))
    # ops: 1000 in, 0 out, batch: $0.0005; prefill 1.0 s, decode 0 s.
    gate.record(ops_p, usage(created=T0 + 20, output=0, tier="batch", prefill_seconds=1.0, decode_seconds=0.0))
    gate.flush()
    conn = connect(db_path)
    yield conn
    conn.close()


def test_group_by_tenant_sums_tokens_cost_and_shares(ledger):
    acme, ops = usage_summary(ledger, "tenant")
    assert (acme.group, acme.requests) == ("acme", 2)
    assert (acme.uncached_prompt_tokens, acme.cache_read_tokens, acme.output_tokens) == (1600, 400, 250)
    assert acme.total_tokens == 2250
    assert acme.cost == pytest.approx(0.0018 + 0.00168)
    assert acme.cost_per_1k_tokens == pytest.approx(0.00348 / 2250 * 1000)
    assert acme.cache_hit_share == pytest.approx(400 / 2000)
    assert (acme.prefill_share, acme.decode_share) == (pytest.approx(0.2), pytest.approx(0.8))
    assert (ops.group, ops.cost, ops.prefill_share) == ("ops", pytest.approx(0.0005), 1.0)


@pytest.mark.parametrize(
    "group_by, expected",
    [
        ("tier", {"default": 0.0018, "priority": 0.00168, "batch": 0.0005}),
        ("model", {"test-model": 0.00398}),
    ],
)
def test_group_by_tier_and_model(ledger, group_by, expected):
    assert {row.group: row.cost for row in usage_summary(ledger, group_by)} == pytest.approx(expected)


def test_group_by_key_and_time_range(ledger):
    assert len(usage_summary(ledger, "key")) == 2
    (only,) = usage_summary(ledger, "tenant", start=T0 + 5, end=T0 + 20)  # half-open: the row at T0+20 is out
    assert (only.group, only.requests, only.cost) == ("acme", 1, pytest.approx(0.00168))
    assert usage_summary(ledger, "tenant", start=T0 + 30) == []


def test_bad_group_by(ledger):
    with pytest.raises(ValueError, match="group_by must be one of"):
        usage_summary(ledger, "tenant; DROP TABLE ledger")


def test_formats(ledger):
    rows = usage_summary(ledger, "tenant")
    table = render(rows, "tenant", "table")
    assert table.splitlines()[0].split()[:3] == ["tenant", "requests", "uncached_in"]
    assert table.splitlines()[-1].split()[:2] == ["total", "3"]
    parsed = list(csv.DictReader(io.StringIO(render(rows, "tenant", "csv"))))
    assert [r["tenant"] for r in parsed] == ["acme", "ops"]
    assert float(parsed[0]["cost"]) == pytest.approx(0.00348)
    document = json.loads(render(rows, "tenant", "json", start=T0))
    assert document["start"] == T0 and document["total"]["requests"] == 3
    assert document["data"][0]["cache_hit_share"] == pytest.approx(0.2)


def test_parse_time():
    assert parse_time("1750000000") == 1_750_000_000.0
    assert parse_time("2025-06-15") == 1_749_945_600.0
    assert parse_time("2025-06-15T12:00:00+02:00") == 1_749_981_600.0
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_time("yesterday")
