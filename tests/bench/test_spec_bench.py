"""`carpool bench spec` runs end to end (tiny sizes, no timing asserts): the same greedy tokens with and
without speculation, and the drafter's acceptance reported."""

import json

from carpool.cli import main


def test_bench_spec_reports_both_engines_side_by_side(tmp_path):
    out = tmp_path / "spec.json"
    png = tmp_path / "img" / "spec.png"
    assert (
        main(
            [
                "bench",
                "spec",
                "--drafters",
                "ngram",
                "--batch-sizes",
                "2",
                "--workloads",
                "docs",
                "--requests-per-stream",
                "1",
                "--max-tokens",
                "8",
                "--max-doc-chars",
                "1500",
                "--dtype",
                "float32",
                "--out",
                str(out),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["workload"] == "docs" and row["streams"] == 2
    plain, ngram = row["plain"], row["ngram"]
    assert plain["output_tokens"] == ngram["output_tokens"] > 0
    assert ngram["speedup"] > 0
    assert plain["draft_tokens"] == 0
    # Every step's choice of drafts is counted, and the policy's measurements per batch-size bucket reported.
    assert sum(ngram["steps_by_num_drafts"].values()) > 0
    assert report["policy_measured_vs_plain"]["ngram"]["2-2"]["vs_plain"]["0"] == 1.0
    # The end-to-end figure's parts: the share of request time before the first token, decode-only tok/s.
    for result in (plain, ngram):
        assert 0 < result["ttft_share"] < 1 and result["decode_tokens_per_s"] > 0
    assert png.read_bytes().startswith(b"\x89PNG")
