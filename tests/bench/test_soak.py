"""`carpool bench soak`, three minutes of it: mixed traffic, a kill -9 and a full disk, then the invariants that hold
in any run: every answer billed once, no budget passed, every batch line answered once, every KV block free."""

import json
import os

import pytest

from carpool.bench import soak
from carpool.cli import build_parser


@pytest.mark.skipif(os.geteuid() != 0, reason="the full-disk window mounts a tmpfs (CI runs as root)")
@pytest.mark.timeout(1800)  # three minutes of traffic, two server starts and the batches' end, on a busy machine too
def test_three_minutes_under_fire_bill_each_answer_once_and_free_every_block(tmp_path):
    out = tmp_path / "soak.json"
    args = build_parser().parse_args(
        ["bench", "soak", "--minutes", "3", "--streams", "8", "--no-warmup", "--out", str(out)]
    )
    soak.main(args)
    report = json.loads(out.read_text())
    assert [fault["fault"] for fault in report["faults"]] == ["kill -9", "disk full"]
    assert "skipped" not in report["faults"][1]
    assert report["outcomes"]["whole"] > 0 and report["outcomes"]["left"] > 0
    ledger = report["ledger"]
    assert ledger["doubled_ids"] == [] and ledger["whole_without_row"] == [] and ledger["over_budget"] == {}
    # Rows billed for requests the client did not receive whole are reported (kind, outcome, whether a fault was on)
    # rather than asserted here: a 3-minute run on a busy machine has shown a few outside the fault windows, not yet
    # explained (issue 55's notes); the hour-long run's report is the evidence.
    assert report["invariants"]["batches_each_line_once"], report["batches"]
    assert report["invariants"]["kv_free_when_idle"], report["idle_kv_usage"]
    assert len(report["rss_mb"]) > 10 and out.with_suffix(".png").exists()  # flatness: the hour-long run's figure
