"""`carpool bench structured` runs end to end (tiny sizes, no timing asserts): validity per format and an
extraction job through the Batch API whose every output is checked against the schema and priced by the ledger."""

import json

from carpool.bench.structured_jobs import RECORD, valid_record
from carpool.cli import main


def test_bench_structured_validity_and_a_batch_extraction_job(tmp_path):
    out = tmp_path / "structured.json"
    assert (
        main(
            [
                "bench",
                "structured",
                "--skip-overhead",
                "--requests",
                "1",
                "--formats",
                "choice",
                "--batch-lines",
                "3",
                "--validity-max-tokens",
                "48",
                "--dtype",
                "float32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["validity"] == {"choice": {"requests": 1, "valid": 1, "invalid": {}}}
    job = report["batch_extraction"]
    assert job["status"] == "completed" and job["lines"] == 3 and job["valid"] == 3, job
    assert job["cost"] > 0 and job["output_tokens"] > 0 and "overhead" not in report


def test_an_extraction_counts_as_valid_only_when_it_matches_the_schema():
    good = {"name": "Maria Rossi", "age": 34, "city": "Lyon", "job": "nurse"}
    assert set(good) == set(RECORD["required"]) and valid_record(json.dumps(good))
    for bad in (
        {**good, "age": "34"},
        {**good, "age": True},
        {k: v for k, v in good.items() if k != "job"},
        {**good, "extra": 1},
        {**good, "city": "x" * 31},
    ):
        assert not valid_record(json.dumps(bad)), bad
    assert not valid_record('{"name": "Maria"') and not valid_record(None)
