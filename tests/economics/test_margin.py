"""The dashboard's margin panel (carpool.economics.margin): revenue per tier and tenant against the machine's bill
over the same time, shared by each group's busy time at the measured seconds per token, on numbers worked by
hand; and a live `carpool serve --hourly-price` whose /dashboard/data carries it."""

import pytest

from carpool.economics.db import open_database
from carpool.economics.margin import MachineBill, margins
from carpool.economics.phase_meter import PhaseTotals
from carpool.economics.prices import load_price_sheet


class FixedMeter:
    def __init__(self, totals: PhaseTotals):
        self._totals = totals

    def totals(self) -> PhaseTotals:
        return self._totals


def insert(conn, at: float, tier: str, tenant: str, prompt: int, output: int, cost: float) -> None:
    conn.execute(
        "INSERT INTO ledger (time, tenant, model, tier, uncached_prompt_tokens, cache_read_tokens,"
        " cache_write_tokens, output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost)"
        " VALUES (?, ?, 'm', ?, ?, 0, 0, ?, 0, 0, 0, 'stop', ?)",
        (at, tenant, tier, prompt, output, cost),
    )


def test_each_group_pays_its_busy_share_of_the_whole_bill_idle_time_included(tmp_path):
    conn = open_database(tmp_path / "carpool.db")
    with conn:
        insert(conn, 500.0, "default", "a", 99_999, 99_999, 9.0)  # before the server started: not in the window
        insert(conn, 1500.0, "default", "a", 2_000, 100, 0.30)  # 2,000 x 1 ms + 100 x 40 ms: 6 s busy
        insert(conn, 1600.0, "flex", "b", 0, 150, 0.05)  # 150 x 40 ms: 6 s busy
    # 10,000 prompt tokens in 10 s and 1,000 output tokens in 40 s: 50 s busy of the 1,000 since the start.
    meter = FixedMeter(
        PhaseTotals(prefill_tokens=10_000, prefill_seconds=10.0, decode_tokens=1_000, decode_seconds=40.0)
    )
    bill = MachineBill(3.60, started=1000.0, phases={"m": meter}, prices=load_price_sheet(None))
    panel = margins(conn, bill, window_start=0.0, now=2000.0)
    conn.close()
    assert panel["machine_cost"] == pytest.approx(1.0)  # $3.60 an hour for 1,000 s
    assert panel["utilization"] == pytest.approx(0.05)
    by_tier = {row["tier"]: row for row in panel["by_tier"]}
    assert by_tier["default"]["machine_cost"] == pytest.approx(0.5) and by_tier["flex"]["machine_cost"] == 0.5
    assert by_tier["default"]["margin"] == pytest.approx(-0.2) and by_tier["flex"]["margin"] == pytest.approx(-0.45)
    assert {row["tenant"]: round(row["margin"], 6) for row in panel["by_tenant"]} == {"a": -0.2, "b": -0.45}
    # 25 output tokens a busy second at 5% busy: 1.25 an hour's second, $800 per 1M; the "*" price is far below.
    below = {(row["model"], row["tier"]): row["cost_output_per_1m"] for row in panel["below_cost"]}
    assert set(below) == {("m", tier) for tier in ("priority", "default", "flex", "batch")}
    assert below["m", "default"] == pytest.approx(800.0)
