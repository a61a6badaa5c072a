"""`carpool bench spec`: the same prompts with and without speculative decoding, side by side in one run.

For each workload (chat: opening prompts of chat_prompts.jsonl; docs: long_docs.jsonl transcripts with a
question or summary request, where prompt lookup shines) and each stream count, the prompts run through a
plain engine and through one engine per drafter (`ngram`, or a draft model sharing the target's tokenizer),
all greedy with the same weights, N requests in flight at once. Speculation is adaptive: at a large batch the
engine may verify no drafts at all, which is the point of the 32-stream row. Reported: output tokens per
second, the speedup over the plain engine, the acceptance rate (accepted / proposed drafts) and the mean
accepted length (drafts kept per verification), how many drafts per sequence the policy chose at each step
(its choice and each k's measured tok/s over plain decoding's, per batch-size bucket, are in the JSON), and
with --plot a PNG of output tok/s against the batch size (the stream counts), plain and per drafter, one panel
per workload. Beside the end-to-end tok/s (the headline), each run reports what it mixes: the share of request
time before the first token (prefill) and the output tok/s of decode-only steps, where speculation acts.
"""

import argparse
import collections
import itertools
import json
import time
from pathlib import Path

import torch

from carpool.bench.datasets import first_human_turns, long_docs
from carpool.engine.args import add_engine_args, engine_config
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.sampling_params import SamplingParams

WORKLOADS = ("chat", "docs")


def add_parser(modes) -> None:
    parser = modes.add_parser("spec", help="speculative decoding: tok/s with and without, per drafter and load")
    add_engine_args(parser)
    parser.add_argument(
        "--drafters",
        nargs="+",
        default=["ngram"],
        help="'ngram' and/or draft models (name or path) sharing --model's tokenizer",
    )
    parser.add_argument(
        "--batch-sizes",
        "--streams",
        dest="streams",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="requests in flight at once (the sweep: one row per value)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=list(WORKLOADS),
        choices=WORKLOADS,
        help="chat: opening prompts of chat_prompts.jsonl; docs: long_docs.jsonl document QA",
    )
    parser.add_argument("--requests-per-stream", type=int, default=2, help="each stream runs this many in turn")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most")
    parser.add_argument("--max-doc-chars", type=int, default=6000, help="skip longer transcripts")
    parser.add_argument("--out", default="bench-results/spec.json", help="where the JSON report goes")
    parser.add_argument("--plot", help="also write a PNG of tok/s against batch size here (e.g. docs/img/spec.png)")
    parser.set_defaults(func=main)


def prompts_for(workload: str, engine: LLMEngine, count: int, max_doc_chars: int) -> list[str]:
    if workload == "chat":
        texts = first_human_turns(count, max_chars=2000)
    else:
        texts = [
            f"{doc['document']}\n\n{doc['question_or_instruction']} Quote the transcript where you can."
            for doc in long_docs()
            if len(doc["document"]) <= max_doc_chars
        ][:count]
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def run(engine: LLMEngine, prompts: list[str], streams: int, max_tokens: int) -> dict:
    """Keep `streams` requests in flight until every prompt is done; greedy, so every engine emits the same."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    queue, ids = list(prompts), itertools.count()
    in_flight = output_tokens = drafted = accepted = verifications = 0
    drafts_per_step = collections.Counter()  # the policy's k at each step
    decode_tokens = decode_seconds = 0.0  # steps that computed no prompt token
    added, first_token, finished = {}, {}, {}  # request id -> time
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and in_flight < streams:
            request_id = f"spec-bench-{next(ids)}"
            engine.add_request(request_id, queue.pop(0), params)
            added[request_id] = time.perf_counter()
            in_flight += 1
        before, step_start = engine.last_step, time.perf_counter()
        step_tokens = 0
        for output in engine.step():
            step_tokens += len(output.delta_token_ids)
            if output.delta_token_ids:
                first_token.setdefault(output.request_id, time.perf_counter())
            if output.finished:
                finished[output.request_id] = time.perf_counter()
            in_flight -= output.finished
        output_tokens += step_tokens
        if engine.last_step is not before and not engine.last_step.num_prefill_tokens:
            decode_tokens += step_tokens
            decode_seconds += time.perf_counter() - step_start
        if engine.speculator:
            drafts_per_step[engine.speculator.k] += 1
        spec = engine.last_step.spec if engine.last_step else None
        if spec:
            drafted += spec.num_draft_tokens
            accepted += spec.num_accepted_tokens
            verifications += spec.num_drafts
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds,
        # What the end-to-end figure mixes: the share of each request's time spent before its first token (the
        # prompt's prefill and the wait for it), and the output tok/s of decode-only steps (no prompt token in them).
        "ttft_share": sum(first_token.get(r, finished[r]) - added[r] for r in finished)
        / sum(finished[r] - added[r] for r in finished),
        "decode_tokens_per_s": decode_tokens / decode_seconds if decode_seconds else None,
        "draft_tokens": drafted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": accepted / verifications if verifications else None,
        "steps_by_num_drafts": {str(k): n for k, n in sorted(drafts_per_step.items())},
    }


def main(args: argparse.Namespace) -> int:
    base_config = engine_config(args)
    base_config.max_num_seqs = max(base_config.max_num_seqs, max(args.streams))
    base_config.speculative_model = None  # the drafters come from --drafters
    plain = LLMEngine(base_config)
    engines = {}
    for drafter in args.drafters:
        config = engine_config(args)
        config.max_num_seqs, config.speculative_model = base_config.max_num_seqs, drafter
        engines[drafter] = LLMEngine(config)
    for engine in [plain, *engines.values()]:  # first steps pay one-time costs (KV pages, kernel set-up)
        run(engine, prompts_for("chat", engine, 1, args.max_doc_chars), 1, 4)
    rows = []
    for workload in args.workloads:
        for streams in args.streams:
            prompts = prompts_for(workload, plain, streams * args.requests_per_stream, args.max_doc_chars)
            row = {"workload": workload, "streams": streams, "plain": run(plain, prompts, streams, args.max_tokens)}
            for drafter, engine in engines.items():
                result = run(engine, prompts, streams, args.max_tokens)
                result["speedup"] = result["output_tokens_per_s"] / row["plain"]["output_tokens_per_s"]
                row[drafter] = result
            rows.append(row)
            print(_format_row(row, list(engines)), flush=True)
    measured = {drafter: engine.speculator.policy.measured() for drafter, engine in engines.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": args.model,
                "dtype": str(plain.dtype),
                "threads": torch.get_num_threads(),
                "num_speculative_tokens": args.num_speculative_tokens,
                "max_tokens": args.max_tokens,
                "results": rows,
                "policy_measured_vs_plain": measured,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    if args.plot:
        plot(rows, list(engines), args.model, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _format_row(row: dict, drafters: list[str]) -> str:
    plain = row["plain"]
    line = (
        f"{row['workload']:>4} N={row['streams']:>2}  plain {plain['output_tokens_per_s']:6.1f} tok/s "
        f"(decode-only {plain['decode_tokens_per_s'] or 0:6.1f}, TTFT share {plain['ttft_share']:.0%})"
    )
    for drafter in drafters:
        r = row[drafter]
        rate = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        decode = r["decode_tokens_per_s"] or 0
        line += (
            f" | {drafter} {r['output_tokens_per_s']:6.1f} tok/s x{r['speedup']:.2f} "
            f"(decode-only {decode:6.1f} x{decode / (plain['decode_tokens_per_s'] or 1):.2f}, "
            f"TTFT share {r['ttft_share']:.0%}, accept {rate}, mean accepted {length})"
        )
    return line


def plot(rows: list[dict], drafters: list[str], model: str, path: Path) -> None:
    """Output tok/s against batch size, plain and per drafter, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    figure, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        mine = [row for row in rows if row["workload"] == workload]
        x = [row["streams"] for row in mine]
        for label in ["plain", *drafters]:
            axis.plot(
                x,
                [row[label]["output_tokens_per_s"] for row in mine],
                marker="o",
                label=label if label == "plain" else f"{label} (adaptive)",
            )
        axis.set(title=workload, xlabel="requests in flight (batch size)", ylabel="output tok/s")
        axis.set_xscale("log", base=2)
        axis.set_xticks(x, [str(v) for v in x])
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"{model}: speculative decoding on and off, greedy")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
