"""The verify-step bench splits a step of verify rows into attention and the rest, per case."""

import torch

from carpool.bench.verify_step import run, verify_rows


def test_verify_rows_are_one_sequence_s_growing_contexts():
    tables, lens, slots, positions = verify_rows(seqs=2, rows=3, context=17, block_size=16, blocks_per_seq=2)
    assert lens.tolist() == [15, 16, 17] * 2 and positions.tolist() == [14, 15, 16] * 2
    assert tables.tolist() == [[0, 1]] * 3 + [[2, 3]] * 3
    assert slots.tolist() == [14, 15, 16, 46, 47, 48]  # each row writes its own key: position 16 opens block 1 / 3


def test_the_step_accounts_for_its_attention():
    report = run("smollm2-135m", contexts=[40], rows=[1, 5], seqs=[1], repeats=1)
    assert [(c["rows"], c["seqs"], c["context"]) for c in report["cases"]] == [(1, 1, 40), (5, 1, 40)]
    assert report["dtype"] in ("torch.bfloat16", "torch.float32")  # bf16 where the CPU has it, fp32 on AVX2-only
    element_bytes = getattr(torch, report["dtype"].removeprefix("torch.")).itemsize
    for case in report["cases"]:
        assert 0 < case["attention_cpu_ms"] < case["step_cpu_ms"]
        assert case["rest_cpu_ms"] == case["step_cpu_ms"] - case["attention_cpu_ms"]
        assert case["kv_bytes"] == 40 * 2 * 3 * 64 * element_bytes * 30  # SmolLM2: 3 KV heads of 64, 30 layers
