"""The `matmul` engine setting end to end: "int8-dot", "int8-dot-all" and "exact" all generate, each engine's steps
run its own mode even when two share a thread (and leave the thread's mode as they found it), "auto" resolves per
kernel path, and a bad value is refused naming the field."""

import argparse

import pytest
import torch
from test_reference import PROMPTS

from carpool import LLM, SamplingParams
from carpool.engine.args import add_engine_args, engine_config
from carpool.engine.config import EngineConfig
from carpool.kernels import kernel_path
from carpool.models.quantization import resolve_matmul

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


def logprobs(llm: LLM) -> list[list[float]]:
    return [[token.logprob for token in output.logprobs] for output in llm.generate(PROMPTS[:2], GREEDY)]


def test_exact_and_int8_dot_engines_each_run_their_own_mode():
    fast = LLM(dtype="float32", max_num_seqs=2, num_kv_blocks=32, matmul="int8-dot")
    exact = LLM(dtype="float32", max_num_seqs=2, num_kv_blocks=32, matmul="exact")
    fast_run, exact_run, fast_again = logprobs(fast), logprobs(exact), logprobs(fast)
    assert fast_again == fast_run  # deterministic, and not left in the other engine's mode
    # int8 activations move the logits a little: the LM head (2 rows) of the prefill step, every linear of a decode
    # step (2 rows) after it
    assert fast_run != exact_run
    for fast_seq, exact_seq in zip(fast_run, exact_run):
        assert abs(fast_seq[0] - exact_seq[0]) < 0.05  # the same context: only the LM head's rounding differs
    assert torch.ops.carpool.get_matmul_mode() == 0  # a step restores the thread's mode: direct kernel calls run exact
    for llm in (fast, exact):
        assert all(len(output.token_ids) == 8 for output in llm.generate(PROMPTS[:2], GREEDY))


def test_int8_dot_all_runs_prompt_chunks_in_integers():
    # 100 prompt tokens: more rows than int8-dot's limit (64 at most), so only int8-dot-all's prefill is int8
    prompt = list(range(1000, 1100))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for matmul in ("int8-dot", "int8-dot-all"):
        output = LLM(dtype="float32", max_num_seqs=1, num_kv_blocks=16, matmul=matmul).generate([prompt], greedy)[0]
        runs[matmul] = [token.logprob for token in output.logprobs]
        assert len(output.token_ids) == 4
    first = runs["int8-dot"][0], runs["int8-dot-all"][0]  # the prefill step's token: the LM head alike, one row
    assert first[0] != first[1] and abs(first[0] - first[1]) < 0.1


def test_auto_resolves_per_kernel_path():
    assert resolve_matmul("auto", "avx2") == resolve_matmul("auto", "avxvnni") == "int8-dot-all"  # fp32 FMAs there
    assert resolve_matmul("auto", "avx512") == resolve_matmul("auto", "portable") == "int8-dot"
    assert resolve_matmul("exact", "avx2") == "exact"
    assert EngineConfig(reproducible=False).matmul == resolve_matmul("auto", kernel_path())
    assert EngineConfig(device="cpu").matmul == "int8-dot-all"  # reproducible by default: every row in integers
    assert EngineConfig(matmul="int8-dot-all").matmul == "int8-dot-all"


def test_a_bad_matmul_value_names_the_field():
    with pytest.raises(ValueError, match="matmul"):
        LLM(matmul="int4")


def test_the_cli_flag_sets_the_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--matmul", "exact"])).matmul == "exact"
    assert engine_config(parser.parse_args(["--matmul", "int8-dot-all"])).matmul == "int8-dot-all"
    fast = engine_config(parser.parse_args(["--reproducible", "off"]))
    assert fast.matmul == resolve_matmul("auto", kernel_path()) and fast.reproducible is False
    assert engine_config(parser.parse_args(["--device", "cpu"])).matmul == "int8-dot-all"  # reproducible
    with pytest.raises(SystemExit):
        parser.parse_args(["--matmul", "int4"])
