"""`carpool capacity plan` on a synthetic ledger of three days with the same morning peak: the forecast is each
minute's mean traffic over the days, the replicas are its machine time over a replica's planned busy share, and
the extra replica is started ahead of the peak by a replica's start time and released after it."""

import json
from datetime import UTC, datetime

import pytest

from carpool.cli import build_parser, main
from carpool.economics import capacity
from carpool.economics.db import open_database
from carpool.economics.phase_meter import PhaseTotals

DAY = 86400
NINE = datetime(2026, 12, 3, 9, 0, tzinfo=UTC).timestamp()  # the first day's peak; the plan is for the fourth day
# 1 ms a prompt token, 20 ms an output token: a request of 1,000 prompt and 100 output tokens is 3 s of machine.
PHASES = PhaseTotals(prefill_tokens=1000, prefill_seconds=1.0, decode_tokens=100, decode_seconds=2.0)


def synthetic_ledger(path, peak_per_minute: int = 20, quiet_per_minute: int = 2) -> None:
    """Three days from 08:30 to 10:00 UTC: `peak_per_minute` requests a minute 09:00-09:29, else the quiet rate,
    each arriving in the first seconds of its minute; and one Batch API request a minute throughout."""
    conn = open_database(path)
    with conn:
        for day in range(3):
            for minute in range(-30, 60):
                at = NINE + day * DAY + minute * 60
                count = peak_per_minute if 0 <= minute < 30 else quiet_per_minute
                for i in range(count):
                    _row(conn, at + i, "default")
                _row(conn, at + 30, "batch")
    conn.close()


def _row(conn, arrived: float, tier: str) -> None:
    conn.execute(
        "INSERT INTO ledger (time, model, tier, uncached_prompt_tokens, cache_read_tokens, cache_write_tokens,"
        " output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost, arrived)"
        " VALUES (?, 'm', ?, 1000, 0, 0, 100, 0, 0, 0, 'stop', 0.001, ?)",
        (arrived + 5, tier, arrived),
    )


def test_the_plan_follows_the_days_peak_and_starts_ahead_of_it(tmp_path):
    synthetic_ledger(tmp_path / "carpool.db")
    conn = open_database(tmp_path / "carpool.db")
    at = NINE + 3 * DAY - 15 * 60  # 08:45 on the fourth day
    planned = capacity.plan(conn, PHASES, at=at, horizon_minutes=60, smooth_minutes=0, target_utilization=0.5)
    conn.close()
    by_clock = {datetime.fromtimestamp(m.at, UTC).strftime("%H:%M"): m for m in planned}
    quiet, peak = by_clock["08:50"], by_clock["09:10"]
    assert (quiet.live.requests, quiet.busy_seconds, quiet.replicas) == (2, pytest.approx(6.0), 1)
    # 20 requests x 3 s = 60 busy seconds a minute, over 30 s a replica (half of each minute): 2 replicas.
    assert (peak.live.requests, peak.busy_seconds, peak.replicas) == (20, pytest.approx(60.0), 2)
    assert peak.batch.requests == 1 and peak.batch.prompt_tokens == 1000  # reported apart, not sized for
    assert [m.replicas for m in planned] == [1] * 15 + [2] * 30 + [1] * 15
    steps = capacity.actions(planned, start_seconds=120)
    assert [(datetime.fromtimestamp(when, UTC).strftime("%H:%M:%S"), what.split(":")[0]) for when, what in steps] == [
        ("08:58:00", "start 1 replica(s)"),
        ("09:30:00", "release 1 replica(s)"),
    ]


def test_smoothing_spreads_a_peak_over_its_neighbouring_minutes(tmp_path):
    synthetic_ledger(tmp_path / "carpool.db")
    conn = open_database(tmp_path / "carpool.db")
    at = NINE + 3 * DAY - 2 * 60
    [before_peak, *_] = capacity.plan(conn, PHASES, at=at, horizon_minutes=1, smooth_minutes=2)
    conn.close()
    # 08:56-09:00 around 08:58; the fourth day's 08:56 and 08:57 have passed without traffic: 2 x 3 days / 4.
    assert before_peak.live.requests == pytest.approx((1.5 + 1.5 + 2 + 2 + 20) / 5)


def test_the_command_prints_the_plan_as_json(tmp_path, capsys):
    synthetic_ledger(tmp_path / "carpool.db")
    bench = tmp_path / "run.json"
    bench.write_text(json.dumps({"phases": PHASES.as_dict()}))
    at = str(NINE + 3 * DAY - 15 * 60)
    argv = ["capacity", "plan", "--db", str(tmp_path / "carpool.db"), "--bench", str(bench), "--at", at]
    assert main([*argv, "--smooth-minutes", "0", "--target-utilization", "0.5", "--format", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert max(minute["replicas"] for minute in document["minutes"]) == 2
    assert document["replica_start_seconds"] == 60.0  # what `carpool serve --capacity-plan` starts ahead by
    assert [action["action"].split(":")[0] for action in document["actions"]] == ["start 1 replica(s)"] + [
        "release 1 replica(s)"
    ]
    with pytest.raises(SystemExit):  # a measurement source is required
        build_parser().parse_args(["capacity", "plan", "--db", str(tmp_path / "carpool.db")])


def test_the_dashboard_traffic_panel_forecasts_today_from_the_days_before_it(tmp_path):
    synthetic_ledger(tmp_path / "carpool.db")
    conn = open_database(tmp_path / "carpool.db")
    now = NINE + 2 * DAY + 10 * 60 + 30  # 09:10:30 on the third day, whose rows are its actual traffic
    panel = capacity.forecast_against_actual(conn, now, minutes=60, smooth_minutes=0)
    conn.close()
    at = {datetime.fromtimestamp(t, UTC).strftime("%H:%M"): i for i, t in enumerate(panel["minutes"])}
    assert len(panel["minutes"]) == 120 and at["08:10"] == 0 and at["10:09"] == 119
    assert [panel["forecast"][at[m]] for m in ("08:20", "08:40", "09:05", "09:40")] == [0, 2, 20, 2]
    assert [panel["actual"][at[m]] for m in ("08:20", "08:40", "09:05", "09:09")] == [0, 2, 20, 20]
    assert panel["actual"][at["09:10"]] is None and panel["forecast"][at["09:20"]] == 20  # the future: forecast only
