"""`carpool bench day`: its arrivals follow the day's shape, and a short day sent to a live server leaves a ledger
that `carpool cost whatif` replays: help-line turns reading their shared system prompt from the cache, document
questions, the nightly batch's lines."""

import json
import os
import random
import sqlite3
import time

import httpx
import pytest
from live_server import LiveServer

from carpool.bench import day, whatif
from carpool.cli import build_parser


def test_the_help_line_peaks_a_third_into_the_day_and_documents_come_steadily():
    schedule = day.arrivals(900.0, 2.0, 0.1, random.Random(3))
    thirds = [[kind for at, kind in schedule if third * 300 <= at < (third + 1) * 300] for third in range(3)]
    help_line = [sum(kind != "doc" for kind in kinds) for kinds in thirds]
    assert help_line[0] > 1.5 * help_line[2] and help_line[1] > 1.5 * help_line[2]
    assert all(15 <= sum(kind == "doc" for kind in kinds) <= 45 for kinds in thirds)  # 30 expected in each
    hard = sum(kind == "hard" for _, kind in schedule) / sum(kind != "doc" for _, kind in schedule)
    assert hard == pytest.approx(1 - day.SIMPLE_SHARE, abs=0.05)
    assert schedule == day.arrivals(900.0, 2.0, 0.1, random.Random(3))


def test_a_short_day_leaves_a_ledger_the_whatif_replays(tmp_path):
    server = LiveServer()
    try:
        args = build_parser().parse_args(
            ["bench", "day", "--url", server.url, "--seconds", "4", "--peak-rate", "1.5", "--doc-rate", "0.5"]
            + ["--max-doc-chars", "1200", "--batch-lines", "2", "--seed", "12", "--out", str(tmp_path / "day.json")]
        )
        assert day.main(args) == 0
        report = json.loads((tmp_path / "day.json").read_text())
        assert report["errors"] == [] and report["batch"]["total"] == 2
        wait_for_batch(server.url, report["batch"]["id"])  # its lines' rows, for the whatif below
        db = os.path.join(server.home, "carpool.db")
        with sqlite3.connect(db) as conn:
            rows = conn.execute(
                "SELECT tier, cache_read_tokens, output_tokens FROM ledger WHERE purpose = 'request'"
            ).fetchall()
    finally:
        server.stop()
    priority = [row for row in rows if row[0] == "priority"]
    assert len(priority) == sum(report["requests"].get(kind, 0) for kind in ("simple", "hard")) >= 2
    assert all(output in (day.SIMPLE_TOKENS, day.HARD_TOKENS) for _, _, output in priority)
    # Every help-line turn after the first reads the desk's ~780-token system prompt from the prefix cache.
    assert sorted(cached for _, cached, _ in priority)[1] >= 700
    assert sum(row[0] == "default" for row in rows) == report["requests"]["doc"]
    out = tmp_path / "whatif.json"
    assert whatif.main(build_parser().parse_args(whatif_args_list(db, out))) == 0
    today = json.loads(out.read_text())["scenarios"][0]
    assert set(today["latency"]) == {"priority", "default", "batch"} and today["hit_rate"] > 0.3
    # The live traffic alone, as `carpool bench ledger-replay` sends it for a validation.
    assert whatif.main(build_parser().parse_args([*whatif_args_list(db, out), "--tiers", "priority,default"])) == 0
    assert set(json.loads(out.read_text())["scenarios"][0]["latency"]) == {"priority", "default"}


def whatif_args_list(db: str, out) -> list[str]:
    return ["cost", "whatif", "--db", db, "--hourly-price", "1.2", "--step", "0.01,0.0004,0.001", "--out", str(out)]


def wait_for_batch(url: str, batch_id: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/v1/batches/{batch_id}").json()["status"] != "completed":
        assert time.monotonic() < deadline, "the day's batch did not complete"
        time.sleep(0.5)
