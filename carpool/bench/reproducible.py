"""What reproducible mode costs (issue 53), side by side in one run: two engines on the same model, one with
`reproducible=True` (the default: every linear row through the int8 kernels' one arithmetic, prompt attention
through the decode kernel) and one with `reproducible=False` (the fast mode: `matmul` "auto", SDPA for prompts),
their measurements taking turns so that a shared machine's noise hits both alike.

    carpool bench reproducible --model smollm2-135m --rounds 5 [--out bench-results/reproducible.json]

Per engine: a decode step of 1 and of 32 sequences (the median step once every prompt is in, the 32 of mixed
lengths from the shipped chat prompts, the one a 500-token transcript), and a 2,000-token prompt's prefill (one
generated token, prefix cache off). Run it once per kernel path with CARPOOL_KERNEL_ISA=<path>; the report names
the path and the CPU.
"""

import argparse
import statistics
import time

import torch

from carpool import LLM, SamplingParams
from carpool.bench.datasets import first_human_turns
from carpool.bench.decode_step import context_prompt
from carpool.bench.report import write_report
from carpool.kernels import cpu_model, kernel_path

DECODE = SamplingParams(max_tokens=2_000, temperature=0, ignore_eos=True)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def decode_step_ms(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """The median of `steps` decode-only steps of these sequences, once all their prompts are computed."""
    engine = llm.engine
    ids = [f"decode-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, DECODE)
    while any(engine.seqs[r].num_computed_tokens < len(p) for r, p in zip(ids, prompts)):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(times) * 1e3


def prefill_ms(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], ONE_TOKEN)
    return (time.perf_counter() - start) * 1e3


def add_parser(modes) -> None:
    parser = modes.add_parser(
        "reproducible",
        help="what reproducible mode costs: decode steps of 1 and 32 sequences and a 2,000-token prefill, "
        "reproducible on and off side by side",
    )
    parser.add_argument("--model", default=None, help="catalog name or GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every measurement, the engines in turn")
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict:
    if args.rounds < 1 or args.steps < 1:
        raise ValueError("--rounds and --steps must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {
        mode: LLM(model=args.model, reproducible=mode == "reproducible", enable_prefix_caching=False, max_num_seqs=32)
        for mode in ("fast", "reproducible")
    }
    tokenizer = engines["fast"].tokenizer
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in first_human_turns(32, 1500)]
    batch = [tokenizer.encode(chat) for chat in chats]
    single = [context_prompt(engines["fast"], 500)]
    long = context_prompt(engines["fast"], 2000)
    cases = {
        "decode step, 1 sequence (ms)": lambda llm: decode_step_ms(llm, single, args.steps),
        "decode step, 32 sequences (ms)": lambda llm: decode_step_ms(llm, batch, args.steps),
        "prefill, 2,000 tokens (ms)": lambda llm: prefill_ms(llm, long),
    }
    for llm in engines.values():  # warm: every shape once
        for measure in cases.values():
            measure(llm)
    samples = {case: {mode: [] for mode in engines} for case in cases}
    for _ in range(args.rounds):
        for case, measure in cases.items():
            for mode, llm in engines.items():
                samples[case][mode].append(measure(llm))
    report = {
        "command": f"carpool bench reproducible --rounds {args.rounds} --steps {args.steps}"
        + (f" --model {args.model}" if args.model else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "kernel_path": kernel_path(),
        "threads": torch.get_num_threads(),
        "model": args.model or "smollm2-135m",
        "matmul": {mode: llm.engine.config.matmul for mode, llm in engines.items()},
        "cases": {},
    }
    print(f"{report['model']}, {report['kernel_path']} path, {report['threads']} threads, {report['cpu']}")
    print("| case | fast | reproducible | cost |")
    print("| --- | --- | --- | --- |")
    for case, by_mode in samples.items():
        fast, repro = (statistics.median(by_mode[mode]) for mode in ("fast", "reproducible"))
        report["cases"][case] = {"fast": fast, "reproducible": repro, "ratio": repro / fast, "samples": by_mode}
        print(f"| {case} | {fast:.1f} | {repro:.1f} | {repro / fast:.2f}x |", flush=True)
    if args.out:
        write_report(args.out, report)
    return report
