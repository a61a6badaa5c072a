"""The offline and prefix benchmarks run end to end and report what they promise (tiny sizes, no timing asserts)."""

import json

from carpool.cli import main


def test_bench_offline_reports_carpool_throughput_and_phases(tmp_path):
    out = tmp_path / "offline.json"
    assert (
        main(
            [
                "bench",
                "offline",
                "--num-prompts",
                "2",
                "--max-tokens",
                "4",
                "--skip-transformers",
                "--dtype",
                "float32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["num_prompts"] == 2 and 2 <= row["carpool"]["output_tokens"] <= 8
    assert report["phases"]["prefill_tokens"] > 0 and report["phases"]["decode_tokens"] > 0
    assert report["model"] == "SmolLM2-135M-Instruct.Q4_1"  # as the server names the embedded model


def test_bench_offline_runs_a_named_model_without_a_chat_template(tmp_path):
    # Gemma 3 270M's GGUF has no chat template: its turns go in as raw prompts (the price sheet's basis run).
    out = tmp_path / "offline.json"
    flags = ["--model", "gemma-3-270m", "--num-prompts", "1", "--max-tokens", "2", "--skip-transformers"]
    assert main(["bench", "offline", *flags, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "gemma-3-270m" and report["phases"]["decode_tokens"] > 0


def test_bench_prefix_computes_fewer_prompt_tokens_with_the_cache(tmp_path):
    out = tmp_path / "prefix.json"
    assert (
        main(
            [
                "bench",
                "prefix",
                "--conversations",
                "2",
                "--system-tokens",
                "64",
                "--meetings",
                "1",
                "--max-doc-words",
                "300",
                "--cached-prefix-tokens",
                "128",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    for workload in ("chat", "docs"):
        on, off = report[workload]["on"], report[workload]["off"]
        assert off["prompt_tokens_computed"] == off["prompt_tokens"]
        assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
    assert report["cached_prefix"]["tokens"] == 128
