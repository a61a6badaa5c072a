"""Decode step time by batch size: `sizes` sequences' worth of steps from one engine, the largest batch first,
then the same sequences aborted down to each smaller size, so every size reads comparable contexts.

    python -m carpool.bench.batch_steps --model qwen2.5-coder-1.5b --sizes 32,25,24,17,9,8 --steps 6

Per size: the median step in ms and per sequence. Where the batched int8 kernel (ggml_gemm.cpp) runs, a step costs
a fixed part (every weight unpacked once a call) plus a part per vector of rows; sizes just past a multiple of the
vector (8 rows on avx2 and avxvnni) show what a partly filled last vector costs.
"""

import argparse
import statistics
import time

import torch

from carpool import LLM, SamplingParams
from carpool.bench.decode_step import context_prompt
from carpool.bench.report import write_report
from carpool.kernels import kernel_path


def _prefilling(engine) -> bool:
    scheduler = engine.scheduler
    return bool(scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running)


def run(model: str, sizes: list[int], steps: int, threads: int, context: int) -> dict:
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes: want batch sizes of at least 1, got {sizes}")
    torch.set_num_threads(threads)
    largest = max(sizes)
    llm = LLM(model=model, max_num_seqs=largest, enable_prefix_caching=False)
    engine = llm.engine
    prompt = context_prompt(llm, context + largest)
    # Enough tokens for every step below and the decodes that ran beside the prompts' chunks; aborted at the end.
    params = SamplingParams(max_tokens=context + (steps + 1) * len(sizes), temperature=0, ignore_eos=True)
    for i in range(largest):  # distinct prompts: the same text, each one token further on
        engine.add_request(f"seq-{i}", prompt[i : i + context], params)
    while _prefilling(engine):
        engine.step()
    rows = []
    for size in sorted(set(sizes), reverse=True):
        while len(engine.scheduler.running) > size:
            engine.abort(engine.scheduler.running[-1].request_id)
        engine.step()  # the first step at this size, untimed
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1000)
            if engine.last_step.num_seqs != size:
                raise RuntimeError(f"a step at size {size} decoded {engine.last_step.num_seqs} sequences")
        median = statistics.median(times)
        rows.append({"size": size, "step_ms": median, "ms_per_sequence": median / size})
    for request_id in list(engine.seqs):
        engine.abort(request_id)
    return {
        "model": model,
        "kernel_path": kernel_path(),
        "matmul": engine.config.matmul,
        "threads": threads,
        "context": context,
        "steps": steps,
        "sizes": rows,
    }


def main(args: argparse.Namespace) -> None:
    report = run(args.model, [int(s) for s in args.sizes.split(",")], args.steps, args.threads, args.context)
    print(
        f"{report['model']}, kernel path {report['kernel_path']}, matmul {report['matmul']}, "
        f"{report['threads']} threads, ~{report['context']}-token contexts; median of {report['steps']} steps"
    )
    print(f"{'sequences':>9} {'step ms':>9} {'ms/seq':>8}")
    for row in report["sizes"]:
        print(f"{row['size']:>9} {row['step_ms']:>9.1f} {row['ms_per_sequence']:>8.2f}")
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="catalog name or path")
    parser.add_argument("--sizes", default="32,24,17,16,8", help="comma-separated batch sizes (sequences a step)")
    parser.add_argument("--steps", type=int, default=6, help="steps timed per size")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens of each sequence, about")
    parser.add_argument("--out", default="", help="also write the JSON report here")
    main(parser.parse_args())
