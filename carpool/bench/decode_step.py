"""Where a single-stream decode step's time goes: the fused decode step (one C++ call for every decoder layer, its
threads in one parallel region), the same call op by op (each kernel forking and joining the threads itself) and
the Python layers, interleaved in one run so that a shared machine's noise hits all three alike.

    python -m carpool.bench.decode_step --model smollm2-135m --rounds 30 --threads 2 --context 1000

Per mode: the step's wall and process CPU time (with --threads 1 the CPU time is the step's own work, whatever
else the machine runs; with more, idle threads' spinning counts too) and the operator calls one step dispatches
(counted by torch.profiler: the machine's load cannot change them). Beside them: every projection and the LM
head run alone at batch 1 (the matmuls) and the attention alone at the sequence's context, so that
overhead = step - matmuls - attention is what neither kernel accounts for (norms, rotary, cache writes,
allocations, Python, metadata, sampling); and the bandwidth floor: the bytes one step streams (every weight, and
the keys and values of the sequence's context, --context tokens of a meeting transcript) over --bandwidth-gbs, and
over the bandwidth measured in the same run: each round also reads a buffer larger than any cache with the step's
threads (the fastest of a few passes), so that a slow step on a shared machine says whether the memory slowed under
it: on the project's 2-core VM (Zen 4) SmolLM2's step measured 4.95 ms one hour and 5.5-8.4 ms the next, while the
buffer read at 30.1 GB/s beside the 8.4 ms one: the neighbours took time from the step, not bandwidth.
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from carpool import LLM, SamplingParams
from carpool.bench.datasets import long_docs
from carpool.bench.report import write_report
from carpool.engine.model_runner import ModelRunner
from carpool.models.layers import projection_parts
from carpool.models.quantization import matmul_mode


def weight_bytes(model) -> int:
    """Bytes of every projection and the LM head: what a decode step streams at least once."""
    return sum(w.numel() * w.element_size() for m in projections(model) for w in projection_parts(m)[0])


def kv_bytes(model, context: int) -> int:
    """Keys and values one decode step reads at `context` tokens: each layer's (a sliding window's at most)."""
    config, dtype = model.config, model.layers[0].self_attn.attn.k_cache.dtype
    layer_token_bytes = ModelRunner.kv_bytes_per_block(config, block_size=1, dtype=dtype) // config.num_layers
    return layer_token_bytes * sum(min(context, layer.self_attn.attn.window or context) for layer in model.layers)


def context_prompt(llm: LLM, tokens: int) -> list[int]:
    """The first `tokens` tokens of the shipped meeting transcripts, run together."""
    ids: list[int] = []
    for doc in long_docs():
        ids += llm.tokenizer.encode(doc["document"])
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"context: the shipped transcripts hold {len(ids)} tokens, fewer than {tokens}")


def projections(model) -> list:
    per_layer = [
        (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for layer in model.layers
    ]
    return [module for modules in per_layer for module in modules] + [model.lm_head]


def matmuls_ms(model, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    calls = []
    for module in projections(model):
        for weight, qtype in zip(*projection_parts(module)):
            x = torch.randn(1, module.in_features, dtype=dtype)
            if qtype >= 0:
                calls.append(lambda x=x, w=weight, q=qtype: torch.ops.carpool.ggml_linear(x, w, q))
            else:
                calls.append(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
    return _median_ms(calls, repeats)


def attention_ms(engine, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    model, seq = engine.model, engine.scheduler.running[0]
    context, block_size = seq.num_computed_tokens, engine.runner.block_size
    table = torch.tensor([seq.block_table[: -(-context // block_size)]])
    lengths = torch.tensor([context])
    q = torch.randn(1, model.config.num_heads, model.config.head_dim, dtype=dtype)
    calls = [
        lambda a=layer.self_attn.attn: torch.ops.carpool.paged_decode_attention(
            q, a.k_cache, a.v_cache, table, lengths, a.scale, a.window
        )
        for layer in model.layers
    ]
    return _median_ms(calls, repeats)


def dispatched_ops(engine) -> int:
    """Operator calls (aten and carpool, nested ones included) that one engine step sends through the dispatcher."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        engine.step()
    return len(profiler.events())


# What the bandwidth is measured on: 256 MiB, past every cache of the machines this project runs on (L3 32 MiB).
STREAM_BYTES = 256 << 20


def stream_gbs(buffer: torch.Tensor, passes: int = 3) -> float:
    """The fastest of `passes` reads of `buffer` by torch's threads (a sum: one add per 4 bytes read), in GB/s."""
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best / 1e9


def _median_ms(calls: list, repeats: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of one pass over `calls`."""
    times = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        for call in calls:
            call()
        times.append(((time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000))
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def run(model_name: str, rounds: int, steps: int, threads: int, bandwidth_gbs: float, context: int) -> dict:
    torch.set_num_threads(threads)
    llm = LLM(model=model_name, max_num_seqs=1)
    engine, model = llm.engine, llm.engine.model
    samples = {"fused": [], "fused-ops": [], "python": []}
    params = SamplingParams(max_tokens=rounds * len(samples) * (steps + 1) + 8, temperature=0, ignore_eos=True)
    seq = engine.add_request("bench", context_prompt(llm, context), params)
    while seq.num_computed_tokens < context:  # the prompt's chunks
        engine.step()
    for _ in range(3):  # warm-up
        engine.step()
    dtype = model.norm.weight.dtype
    attention, bandwidths = [], []
    buffer = torch.ones(STREAM_BYTES // 4)
    for _ in range(rounds):
        bandwidths.append(stream_gbs(buffer))
        for mode, runs in samples.items():
            model.fused_decode = mode != "python"
            model.decode_stack().set_one_region(mode == "fused")
            engine.step()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                engine.step()
            wall, cpu = (time.perf_counter() - wall) * 1000 / steps, (time.process_time() - cpu) * 1000 / steps
            runs.append((wall, cpu))
        attention.append(attention_ms(engine, dtype, 3))
    ops = {}
    for mode in samples:
        model.fused_decode = mode != "python"
        model.decode_stack().set_one_region(mode == "fused")
        ops[mode] = dispatched_ops(engine)
    model.fused_decode = True
    model.decode_stack().set_one_region(True)
    with matmul_mode(engine.config.matmul):  # the engine's mode, as its steps run (a thread's default is exact)
        matmuls = matmuls_ms(model, dtype, 5)
    attend = tuple(statistics.mean(a[i] for a in attention) for i in range(2))
    mean_context = context + rounds * len(samples) * (steps + 1) // 2  # the context grows a token a step
    weights, keys_values = weight_bytes(model), kv_bytes(model, mean_context)
    floor = (weights + keys_values) / (bandwidth_gbs * 1e9) * 1000
    measured_gbs = statistics.median(bandwidths)
    measured_floor = (weights + keys_values) / (measured_gbs * 1e9) * 1000
    report = {
        "model": model_name,
        "threads": threads,
        "dtype": str(dtype),
        "steps_per_round": steps,
        "rounds": rounds,
        "context": context,
        "mean_context": mean_context,
        "matmuls_ms": matmuls,
        "attention_ms": attend,
        "weight_bytes": weights,
        "kv_bytes": keys_values,
        "floor_ms": floor,
        "bandwidth_gbs": bandwidth_gbs,
        "measured_bandwidth_gbs": measured_gbs,
        "measured_floor_ms": measured_floor,
    }
    for mode, values in samples.items():
        wall, cpu = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        report[mode] = {
            "wall_ms": wall,
            "cpu_ms": cpu,
            "overhead_wall_ms": wall - matmuls[0] - attend[0],
            "overhead_cpu_ms": cpu - matmuls[1] - attend[1],
            "x_floor": wall / floor,
            "x_measured_floor": wall / measured_floor,
            "ops_per_step": ops[mode],
        }
    return report


def main(args: argparse.Namespace) -> None:
    report = run(args.model, args.rounds, args.steps, args.threads, args.bandwidth_gbs, args.context)
    (matmul_wall, matmul_cpu), (attention_wall, attention_cpu) = report["matmuls_ms"], report["attention_ms"]
    print(
        f"{report['model']} ({report['dtype']}, {report['threads']} threads): matmuls alone "
        f"{matmul_wall:.2f} ms ({matmul_cpu:.2f} CPU), attention alone {attention_wall:.2f} ms "
        f"({attention_cpu:.2f} CPU) at {report['mean_context']} tokens of context, floor {report['floor_ms']:.2f} ms "
        f"({report['weight_bytes'] / 1e6:.0f} MB of weights + {report['kv_bytes'] / 1e6:.1f} MB of keys and values "
        f"at {args.bandwidth_gbs} GB/s); measured between rounds {report['measured_bandwidth_gbs']:.1f} GB/s, "
        f"floor {report['measured_floor_ms']:.2f} ms"
    )
    for mode in ("python", "fused-ops", "fused"):
        r = report[mode]
        print(
            f"  {mode:9s} layers: {r['wall_ms']:.2f} ms/step ({r['cpu_ms']:.2f} CPU), overhead "
            f"{r['overhead_wall_ms']:.2f} ms ({r['overhead_cpu_ms']:.2f} CPU), {r['x_floor']:.2f}x the floor, "
            f"{r['x_measured_floor']:.2f}x the measured floor, {r['ops_per_step']} operator calls"
        )
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="catalog name or path")
    parser.add_argument("--rounds", type=int, default=30, help="alternations of the two modes")
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per mode and round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--bandwidth-gbs", type=float, default=53.0, help="memory bandwidth for the floor")
    parser.add_argument("--context", type=int, default=16, help="prompt tokens before the timed steps")
    parser.add_argument("--out", default="", help="also write the JSON report here")
    main(parser.parse_args())
