"""What reproducible prompt attention costs: a prompt's chunks attended by SDPA (the default) and by the paged decode
kernel (a reproducible step: carpool.models.attention), side by side in one run, alternating call by call.

    python -m carpool.bench.prefill_attention --dtype bfloat16 float32
    python -m carpool.bench.prefill_attention --model smollm2-135m --whole 2000

Per case, one layer's PagedAttention over the chunks (SmolLM2's 9 query / 3 KV heads of 64 by default, a 16-token
block pool of random values in a random block order): a 2,000-token prompt in chunks of 512 from position 0, and
one 512-token chunk behind 1,500 cached tokens. Medians of wall time on the process's threads. On a machine shared
with other work, set OMP_WAIT_POLICY=PASSIVE: libgomp's spinning threads (its default) slowed SDPA several-fold
there (a 2,000-token prompt's bf16 chunks, one layer: 188 ms, 27 passive) and the whole prefill about 3x. --whole: the model's
whole prefill of a prompt of that many tokens through `LLM(...)` (max_tokens 1), reproducible on and off in turn.
"""

import argparse
import statistics
import time

import torch

from carpool.engine.block_manager import cdiv
from carpool.models.attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillSegment,
    attention_metadata,
    prompt_rows,
)

BLOCK_SIZE = 16


def chunk_metadata(table: torch.Tensor, start: int, n: int, reproducible: bool) -> AttentionMetadata:
    """A step of one prompt chunk (positions start.. of a sequence with block table `table`), as the model runner
    builds it."""
    slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)])
    blocks = table[: cdiv(start + n, BLOCK_SIZE)]
    rows = prompt_rows(table, BLOCK_SIZE, 0, start, n) if reproducible else None
    segment = PrefillSegment(0, n, start + n, blocks if start else None, rows)
    return AttentionMetadata(slot_mapping=slots, prefills=[segment])


def attention_ms(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, chunks: list[tuple[int, int]], repeats: int
) -> dict[str, float]:
    """Median ms of the chunks' attention (one layer), SDPA and kernel alternating."""
    g = torch.Generator().manual_seed(0)
    context = max(start + n for start, n in chunks)
    num_blocks = cdiv(context, BLOCK_SIZE) + 8
    attention = PagedAttention(heads, kv_heads, head_dim)
    pool = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype)
    attention.k_cache, attention.v_cache = pool[0], pool[1]
    table = torch.randperm(num_blocks, generator=g)
    inputs = [
        tuple(torch.randn(n, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        for _, n in chunks
    ]
    steps = {
        name: [chunk_metadata(table, start, n, reproducible) for start, n in chunks]
        for name, reproducible in (("sdpa", False), ("kernel", True))
    }
    times = {name: [] for name in steps}
    for _ in range(repeats + 1):  # the first round warms up
        for name, metas in steps.items():
            begin = time.perf_counter()
            for meta, (q, k, v) in zip(metas, inputs):
                with attention_metadata(meta):
                    attention(q, k, v)
            times[name].append((time.perf_counter() - begin) * 1000)
    return {name: statistics.median(ms[1:]) for name, ms in times.items()}


def whole_prefill_ms(model: str, tokens: int, repeats: int) -> dict[str, float]:
    """Median ms of a `tokens`-token prompt's whole prefill (max_tokens 1), reproducible on and off in turn; each
    prompt new (no prefix-cache hit)."""
    from carpool import LLM, SamplingParams

    llm = LLM(model=model, enable_prefix_caching=False)
    runner = llm.engine.runner
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = {"off": [], "on": []}
    for i in range(repeats + 1):
        for name, ms in times.items():
            runner.reproducible = name == "on"
            prompt = [100 + (i * 7919 + t * 31) % 20000 for t in range(tokens)]
            begin = time.perf_counter()
            llm.generate([prompt], params)
            ms.append((time.perf_counter() - begin) * 1000)
    return {name: statistics.median(ms[1:]) for name, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("Q", "KV", "HEAD_DIM"))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--model", default=None, help="the model of --whole (default: the engine's default)")
    parser.add_argument("--whole", type=int, default=0, help="also time a prompt of this many tokens' whole prefill")
    args = parser.parse_args()
    from carpool.kernels import kernel_path

    print(f"kernel path {kernel_path()}, {torch.get_num_threads()} threads")
    cases = {
        "2,000-token prompt, chunks of 512": [(0, 512), (512, 512), (1024, 512), (1536, 464)],
        "512-token chunk behind 1,500 cached": [(1500, 512)],
    }
    for dtype in args.dtype:
        for case, chunks in cases.items():
            ms = attention_ms(getattr(torch, dtype), *args.heads, chunks, args.repeats)
            print(
                f"{dtype:9} {case:38} one layer: sdpa {ms['sdpa']:7.2f} ms  kernel {ms['kernel']:7.2f} ms"
                f"  ({ms['kernel'] / ms['sdpa']:.2f}x)"
            )
    if args.whole:
        ms = whole_prefill_ms(args.model, args.whole, max(1, args.repeats // 3))
        print(
            f"whole prefill of {args.whole} tokens: reproducible off {ms['off']:.0f} ms, on {ms['on']:.0f} ms"
            f" ({ms['on'] / ms['off']:.2f}x)"
        )


if __name__ == "__main__":
    main()
