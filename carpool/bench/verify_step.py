"""What a speculative verify step costs: decode steps of S sequences with R query rows each (a sequence's last
token and R - 1 drafts, each row seeing one key more than the row before), at given context lengths, against the
step's paged attention alone, in process CPU time on one thread (the step's own work, whatever else the machine
runs; medians).

    python -m carpool.bench.verify_step --model smollm2-135m --contexts 100 1500 --rows 1 3 5 --seqs 1 8

Per case: the whole fused decode step (model forward, engine's matmul mode), the attention alone (every layer's
paged_decode_attention over the same rows), the rest (matmuls, norms, rotary: step - attention), and the bytes of
K/V the attention must read at least once (each sequence's context, every layer) as GB/s of attention time.
The KV pool holds random values: timing does not depend on them.
"""

import argparse
import itertools
import statistics
import time

import torch

from carpool import LLM
from carpool.models.attention import AttentionMetadata, DecodeGroup, attention_metadata
from carpool.models.quantization import matmul_mode


def verify_rows(seqs: int, rows: int, context: int, block_size: int, blocks_per_seq: int):
    """Block tables, context lengths, cache slots and positions of `seqs` sequences' `rows` verify rows each."""
    tables, lens, slots = [], [], []
    for s in range(seqs):
        table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        for length in range(context - rows + 1, context + 1):
            tables.append(table)
            lens.append(length)
            slots.append(table[(length - 1) // block_size] * block_size + (length - 1) % block_size)
    lens_t = torch.tensor(lens)
    return torch.tensor(tables), lens_t, torch.tensor(slots), lens_t - 1


def _median_cpu_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times)


def run(model_name: str, contexts: list[int], rows: list[int], seqs: list[int], repeats: int) -> dict:
    torch.set_num_threads(1)
    block_size = 16
    blocks_per_seq = -(-max(contexts) // block_size)
    llm = LLM(
        model=model_name, max_num_seqs=max(seqs), num_kv_blocks=max(seqs) * blocks_per_seq + 1, block_size=block_size
    )
    engine, model = llm.engine, llm.engine.model
    config, dtype = model.config, model.norm.weight.dtype
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        attention = layer.self_attn.attn
        for cache in (attention.k_cache, attention.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    cases = []
    for context, n_seqs, n_rows in itertools.product(contexts, seqs, rows):
        tables, lens, slots, positions = verify_rows(n_seqs, n_rows, context, block_size, blocks_per_seq)
        ids = torch.randint(100, 1000, (len(lens),), generator=generator)
        meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, len(lens), tables, lens)])
        q = torch.randn(len(lens), config.num_heads, config.head_dim, generator=generator).to(dtype)

        def step():
            with attention_metadata(meta), matmul_mode(engine.config.matmul):
                model(ids, positions)

        def attend():
            for layer in model.layers:
                a = layer.self_attn.attn
                torch.ops.carpool.paged_decode_attention(q, a.k_cache, a.v_cache, tables, lens, a.scale, a.window)

        step()  # warm-up
        attend()
        step_ms, attention_ms = _median_cpu_ms(step, repeats), _median_cpu_ms(attend, repeats)
        kv_bytes = n_seqs * context * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize * len(model.layers)
        cases.append(
            {
                "context": context,
                "seqs": n_seqs,
                "rows": n_rows,
                "step_cpu_ms": step_ms,
                "attention_cpu_ms": attention_ms,
                "rest_cpu_ms": step_ms - attention_ms,
                "kv_bytes": kv_bytes,
                "attention_gbs": kv_bytes / attention_ms / 1e6,
            }
        )
    return {"model": model_name, "matmul": engine.config.matmul, "dtype": str(dtype), "cases": cases}


def main(args: argparse.Namespace) -> None:
    report = run(args.model, args.contexts, args.rows, args.seqs, args.repeats)
    print(f"{report['model']} ({report['dtype']}, matmul {report['matmul']}, 1 thread, CPU ms, medians)")
    for c in report["cases"]:
        print(
            f"  context {c['context']:5d}, {c['seqs']} seq x {c['rows']} rows: step {c['step_cpu_ms']:7.2f}, "
            f"attention {c['attention_cpu_ms']:6.2f} ({c['attention_cpu_ms'] / c['step_cpu_ms']:4.0%}), rest "
            f"{c['rest_cpu_ms']:6.2f}; KV {c['kv_bytes'] / 1e6:6.1f} MB at {c['attention_gbs']:5.1f} GB/s"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="catalog name or path")
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1500], help="the last row's keys")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 5], help="query rows per sequence")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8], help="sequences in the step")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per case (median)")
    main(parser.parse_args())
