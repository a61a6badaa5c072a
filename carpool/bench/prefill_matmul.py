"""Prefill time per matmul mode: one prompt (long_docs.jsonl's first document, cut to --tokens) prefilled by one
engine per mode, the modes taking turns in one process, the best of --rounds. One thread, timed in the calling
thread's CPU time (OpenMP runs a 1-thread region inline), so a loaded machine moves the ratio little.

    python -m carpool.bench.prefill_matmul [--model smollm2-135m] [--tokens 512] [--modes exact int8-dot-all]
"""

import argparse
import time

from carpool import LLM, SamplingParams
from carpool.bench.datasets import long_docs
from carpool.kernels import kernel_path
from carpool.models.quantization import MATMUL_MODES


def run(model: str, tokens: int, modes: list[str], rounds: int) -> dict:
    """{"tokens": the prompt's length, "seconds": {mode: best CPU seconds of one prefill}}."""
    engines = {
        mode: LLM(
            model,
            matmul=mode,
            num_threads=1,
            max_num_seqs=1,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(512, tokens),
            num_kv_blocks=tokens // 16 + 8,
        )
        for mode in modes
    }
    prompt = engines[modes[0]].tokenizer.encode(next(long_docs())["document"])[:tokens]
    one_token = SamplingParams(max_tokens=1, temperature=0)
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(rounds):
        for mode, llm in engines.items():
            start = time.thread_time()
            llm.generate([prompt], one_token)
            best[mode] = min(best[mode], time.thread_time() - start)
    return {"tokens": len(prompt), "seconds": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=512, help="prompt length; one step prefills up to 512")
    parser.add_argument("--modes", nargs="+", default=["exact", "int8-dot-all"], choices=MATMUL_MODES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report = run(args.model, args.tokens, args.modes, args.rounds)
    best, first = report["seconds"], args.modes[0]
    print(
        f"{args.model}, kernel path {kernel_path()}, a {report['tokens']}-token prompt, 1 thread, CPU seconds: "
        + ", ".join(f"{mode} {seconds:.3f} ({best[first] / seconds:.2f}x {first})" for mode, seconds in best.items())
    )


if __name__ == "__main__":
    main()
