"""`carpool bench compression` keeps what it measured: the report is written after every rate (a long run that is
stopped keeps its rows), and a run of one workload keeps the other workload's rows from the existing report."""

import argparse
import json

from carpool.bench import compression


def test_a_run_of_one_workload_saves_every_rate_and_keeps_the_other(tmp_path, monkeypatch):
    out, png = tmp_path / "compression.json", tmp_path / "compression.png"
    qa = [{"rate": 1, "docs": 4, "agreement_f1": 1.0}, {"rate": 10, "docs": 4, "agreement_f1": 0.4}]
    out.write_text(json.dumps({"gsm8k": [{"rate": 1}], "qa": qa}))
    seen_on_disk = []

    async def run(args, save):
        report = {"scorer": "s", "rates": [1, 10], "gsm8k": []}
        for rate, accuracy in ((10, 0.1), (1, 0.4)):  # any order: the plot sorts by rate
            report["gsm8k"].append({"rate": rate, "problems": 50, "accuracy": accuracy})
            save(report)
            seen_on_disk.append(json.loads(out.read_text()))
        return report

    monkeypatch.setattr(compression, "run", run)
    args = argparse.Namespace(out=str(out), plot=str(png), workloads=["gsm8k"])
    assert compression.main(args) == 0
    assert [len(saved["gsm8k"]) for saved in seen_on_disk] == [1, 2]  # each rate on disk as soon as it ran
    assert all(saved["qa"] == qa for saved in seen_on_disk)  # the other workload's rows, not the old gsm8k ones
    final = json.loads(out.read_text())
    assert [row["rate"] for row in final["gsm8k"]] == [10, 1] and final["qa"] == qa
    assert png.stat().st_size > 0
