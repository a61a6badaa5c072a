"""`carpool bench soak`, minutes of it on each ledger: mixed traffic, a kill -9, a full disk (and on PostgreSQL an
outage of the database), then the invariants that hold in any run: every answer billed once, no budget passed,
every batch line answered once, every KV block free, memory within the start plus the KV pools."""

import json
import os

import pytest

from carpool.bench import soak
from carpool.cli import build_parser

FAULTS = {"sqlite": ["kill -9", "disk full"], "postgres": ["kill -9", "postgres down", "disk full"]}


@pytest.mark.skipif(os.geteuid() != 0, reason="the full-disk window mounts a tmpfs (CI runs as root)")
@pytest.mark.timeout(1800)  # minutes of traffic, two server starts and the batches' end, on a busy machine too
# Faults land in turn, each waiting for the one before (a restart takes 10-30 s on a loaded machine): 1.5 minutes
# still leave the PostgreSQL run's third fault inside its traffic.
@pytest.mark.parametrize(("db", "minutes"), [("sqlite", "2"), ("postgres", "1.5")])
def test_minutes_under_fire_bill_each_answer_once_and_free_every_block(tmp_path, db, minutes):
    out = tmp_path / "soak.json"
    args = build_parser().parse_args(
        ["bench", "soak", "--minutes", minutes, "--db", db, "--streams", "8", "--no-warmup", "--out", str(out)]
    )
    soak.main(args)
    report = json.loads(out.read_text())
    assert [fault["fault"] for fault in report["faults"]] == FAULTS[db]
    assert all("skipped" not in fault for fault in report["faults"])
    assert report["outcomes"]["whole"] > 0 and report["outcomes"]["left"] > 0
    ledger = report["ledger"]
    assert ledger["doubled_ids"] == [] and ledger["whole_without_row"] == [] and ledger["over_budget"] == {}
    # Rows billed for requests the client did not receive whole are reported (kind, outcome, whether a fault was on)
    # rather than asserted here: a 3-minute run on a busy machine has shown a few outside the fault windows, not yet
    # explained (issue 55's notes); the hour-long run's report is the evidence.
    assert report["invariants"]["batches_each_line_once"], report["batches"]
    assert report["invariants"]["kv_free_when_idle"], report["idle_kv_usage"]
    # Memory: the pools' pages are told apart from the rest (flatness of the rest is the hour-long run's figure).
    assert len(report["memory"]) > 10 and out.with_suffix(".png").exists()
    assert all(0 < sample["kv_resident_mb"] <= sample["kv_pool_mb"] for sample in report["memory"][5:])
    assert report["invariants"]["rss_within_start_plus_pools"], report["memory_checks"]
