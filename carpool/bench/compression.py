"""`carpool bench compression`: what prompt compression (LLMLingua, `prompt_compression`) costs in answer quality
and saves in time and money, at keep rates 1x (no compression), 2x, 5x and 10x.

Two workloads, served in process through the real API path (create_app over AsyncEngines; the scorer is one of
the served models and its ledger rows are counted):
  gsm8k: 8-shot chain-of-thought prompts (the demonstrations are the first 8 problems of gsm8k.jsonl, never
         scored; the scored problems follow them), /v1/completions, greedy: exact-match accuracy of the final
         number, per rate.
  qa:    long_docs.jsonl transcripts with their question, /v1/chat/completions, greedy: agreement of each
         compressed answer with the same model's full-prompt answer (unigram F1, as SQuAD scores answers),
         time to first token (client send -> first token: compression included) and cost per request from the
         shipped price sheet (the request's row plus its scorer row), one request at a time.
Writes a JSON report (after every rate, so a long run that is stopped keeps what it measured; the workloads not
run this time are kept from an existing report at --out, so gsm8k and qa may run separately) and a PNG of
accuracy/agreement vs compression.
"""

import argparse
import asyncio
import itertools
import json
import os
import re
import time
from collections import Counter
from pathlib import Path

from carpool.bench.datasets import gsm8k, long_docs
from carpool.economics.prices import load_price_sheet
from carpool.server.open_gate import RecordingGate

RATES = (1, 2, 5, 10)  # compression: 1/keep rate
NUM_SHOTS = 8
QA_SYSTEM = "Answer the question about the meeting transcript in one or two sentences."


def add_parser(modes) -> None:
    parser = modes.add_parser("compression", help="prompt compression: accuracy, agreement, TTFT and cost per rate")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["gsm8k", "qa"],
        choices=["gsm8k", "qa"],
        help="gsm8k: 8-shot chain-of-thought accuracy; qa: transcript answers vs the full prompt's",
    )
    parser.add_argument("--rates", type=int, nargs="+", default=list(RATES), help="compression factors (1 = none)")
    parser.add_argument("--gsm8k-model", default="qwen2.5-coder-1.5b", help="the model answering GSM8K")
    parser.add_argument("--qa-model", default="qwen2.5-coder-1.5b", help="the model answering the transcripts")
    parser.add_argument(
        "--scorer", default="smollm2-135m", help="the served model scoring tokens (LLMLingua's small LM)"
    )
    parser.add_argument("--problems", type=int, default=50, help="GSM8K problems scored")
    parser.add_argument("--docs", type=int, default=20, help="transcripts asked")
    parser.add_argument("--gsm8k-max-tokens", type=int, default=200, help="chain-of-thought tokens at most")
    parser.add_argument("--qa-max-tokens", type=int, default=48, help="answer tokens at most")
    parser.add_argument("--concurrency", type=int, default=8, help="GSM8K requests in flight at once")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench-results/compression.json", help="where the JSON report goes")
    parser.add_argument("--plot", default="docs/img/compression.png", help="accuracy vs compression PNG")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    path = Path(args.out)
    earlier = json.loads(path.read_text()) if path.exists() else {}
    kept = {
        workload: earlier[workload]
        for workload in ("gsm8k", "qa")
        if workload in earlier and workload not in args.workloads
    }

    def save(report: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept | report, indent=2) + "\n")

    report = kept | asyncio.run(run(args, save))
    save(report)
    print(f"wrote {path}")
    plot(report, args.plot)
    print(f"wrote {args.plot}")
    return 0


async def run(args: argparse.Namespace, save=lambda report: None) -> dict:
    """The report; `save(report)` is called after every rate with the rows so far."""
    import httpx

    from carpool.engine.async_engine import AsyncEngine, EngineLoop
    from carpool.engine.config import EngineConfig
    from carpool.server.app import create_app

    models = dict.fromkeys([args.scorer] + [getattr(args, f"{w}_model") for w in args.workloads])
    loop = EngineLoop()
    engines = {
        name: AsyncEngine(
            EngineConfig(model=name, num_threads=args.num_threads, max_num_seqs=16), engine_loop=loop, warmup=False
        )
        for name in models
    }
    gate = RecordingGate()
    app = create_app(engines, gate, compression_model=args.scorer)
    for engine in engines.values():
        engine.start()
    report = {"scorer": args.scorer, "rates": args.rates, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://carpool", timeout=None
        ) as client:
            for workload, run_workload in (("gsm8k", run_gsm8k), ("qa", run_qa)):
                if workload in args.workloads:
                    report[workload] = []
                    await run_workload(client, gate, args, report[workload], lambda: save(report))
    finally:
        for engine in engines.values():
            engine.stop()
    return report


# GSM8K ---------------------------------------------------------------------------------------------------


def cot_answer(answer: str) -> str:
    """GSM8K's worked answer as chain-of-thought text: calculator notes removed, the number stated at the end."""
    steps, final = answer.split("####")
    return f"{re.sub(r'<<[^>]*>>', '', steps).strip()}\nThe answer is {final.strip()}."


def gsm8k_prompt(demos: list[dict], question: str) -> str:
    shots = "\n\n".join(
        f"Question: {d['question']}\nLet's think step by step\n{cot_answer(d['answer'])}" for d in demos
    )
    return f"{shots}\n\nQuestion: {question}\nLet's think step by step\n"


def final_number(text: str) -> str | None:
    stated = re.findall(r"answer is \$?(-?[\d,]*\.?\d+)", text)
    numbers = stated or re.findall(r"-?[\d,]*\.?\d+", text)
    return numbers[0 if stated else -1].replace(",", "").rstrip(".") if numbers else None


def same_number(a: str | None, b: str) -> bool:
    try:
        return a is not None and abs(float(a) - float(b.replace(",", ""))) < 1e-6
    except ValueError:
        return False


async def run_gsm8k(client, gate: RecordingGate, args: argparse.Namespace, rows: list, saved) -> None:
    """Appends a row to `rows` per rate, calling `saved()` after each."""
    problems = list(itertools.islice(gsm8k(), NUM_SHOTS + args.problems))
    demos, scored = problems[:NUM_SHOTS], problems[NUM_SHOTS:]
    for rate in args.rates:
        limit = asyncio.Semaphore(args.concurrency)

        async def ask(problem):
            body = {
                "model": args.gsm8k_model,
                "prompt": gsm8k_prompt(demos, problem["question"]),
                "max_tokens": args.gsm8k_max_tokens,
                "temperature": 0,
                "stop": ["\n\nQuestion:", "\nQuestion:"],
            }
            if rate > 1:
                body["prompt_compression"] = {"rate": 1 / rate}
            async with limit:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            answer = response.json()
            truth = problem["answer"].split("####")[-1].strip()
            return same_number(final_number(answer["choices"][0]["text"]), truth), answer["usage"]

        start, first_row = time.monotonic(), len(gate.records)
        results = await asyncio.gather(*(ask(p) for p in scored))
        usage = [u for _, u in results]
        scorer_rows = [r for r in gate.records[first_row:] if r.purpose == "compression"]
        row = {
            "rate": rate,
            "problems": len(scored),
            "accuracy": sum(ok for ok, _ in results) / len(results),
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage) / len(usage),
            "original_prompt_tokens": sum(
                u["prompt_tokens_details"].get("original_prompt_tokens", u["prompt_tokens"]) for u in usage
            )
            / len(usage),
            "completion_tokens": sum(u["completion_tokens"] for u in usage) / len(usage),
            "cost_per_request": _cost(gate.records[first_row:]) / len(usage),
            # What the scorer read per request, and how much of it came from its prefix cache.
            "scorer_prompt_tokens": sum(r.prompt_tokens for r in scorer_rows) / len(usage),
            "scorer_cached_tokens": sum(r.cached_tokens for r in scorer_rows) / len(usage),
            "seconds": time.monotonic() - start,
            "load_average": os.getloadavg()[0],
        }  # what the seconds ran beside
        print(
            f"gsm8k {rate:>3}x: accuracy {row['accuracy']:.3f}, prompt {row['prompt_tokens']:.0f} of "
            f"{row['original_prompt_tokens']:.0f} tokens, ${row['cost_per_request']:.7f}/request, "
            f"{row['seconds']:.0f} s",
            flush=True,
        )
        rows.append(row)
        saved()


# Transcript QA ---------------------------------------------------------------------------------------------


def unigram_f1(a: str, b: str) -> float:
    left, right = Counter(re.findall(r"\w+", a.lower())), Counter(re.findall(r"\w+", b.lower()))
    common = sum((left & right).values())
    if not common:
        return float(not left and not right)
    precision, recall = common / sum(left.values()), common / sum(right.values())
    return 2 * precision * recall / (precision + recall)


async def run_qa(client, gate: RecordingGate, args: argparse.Namespace, rows: list, saved) -> None:
    """Appends a row to `rows` per rate, calling `saved()` after each."""
    docs = list(itertools.islice(long_docs(), args.docs))
    full_answers: dict[str, str] = {}
    for rate in args.rates:
        ttft, agreement, reference_f1, cost, prompt, original = [], [], [], [], [], []
        for doc in docs:
            body = {
                "model": args.qa_model,
                "max_tokens": args.qa_max_tokens,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": QA_SYSTEM},
                    {"role": "user", "content": f"{doc['document']}\n\nQuestion: {doc['question_or_instruction']}"},
                ],
            }
            if rate > 1:
                body["prompt_compression"] = {"rate": 1 / rate}
            first_row = len(gate.records)
            start = time.monotonic()
            response = await client.post("/v1/chat/completions", json=body)
            elapsed = time.monotonic() - start
            response.raise_for_status()
            answer = response.json()
            text = answer["choices"][0]["message"]["content"] or ""
            rows_now = gate.records[first_row:]
            request_row = next(r for r in rows_now if r.purpose == "request")
            # Client send -> first token: the whole wall time less the decode that followed the first token.
            ttft.append(elapsed - request_row.decode_seconds)
            cost.append(_cost(rows_now))
            if rate == 1:
                full_answers[doc["id"]] = text
            agreement.append(unigram_f1(text, full_answers.get(doc["id"], text)))
            reference_f1.append(unigram_f1(text, doc["reference"]))
            prompt.append(answer["usage"]["prompt_tokens"])
            original.append(
                answer["usage"]["prompt_tokens_details"].get("original_prompt_tokens", answer["usage"]["prompt_tokens"])
            )
        n = len(docs)
        row = {
            "rate": rate,
            "docs": n,
            "agreement_f1": sum(agreement) / n,
            "reference_f1": sum(reference_f1) / n,
            "ttft_mean_s": sum(ttft) / n,
            "ttft_p50_s": sorted(ttft)[n // 2],
            "cost_per_request": sum(cost) / n,
            "prompt_tokens": sum(prompt) / n,
            "original_prompt_tokens": sum(original) / n,
        }
        print(
            f"qa    {rate:>3}x: agreement F1 {row['agreement_f1']:.3f}, reference F1 {row['reference_f1']:.3f}, "
            f"TTFT {row['ttft_mean_s']:.2f} s, prompt {row['prompt_tokens']:.0f} of {row['original_prompt_tokens']:.0f}"
            f" tokens, ${row['cost_per_request']:.7f}/request",
            flush=True,
        )
        rows.append(row)
        saved()


def _cost(records) -> float:
    prices = load_price_sheet()
    return sum(prices.cost(record) for record in records)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rates = set()
    for workload, key, style, label in (
        ("gsm8k", "accuracy", "o-", "GSM8K 8-shot accuracy ({n} problems)"),
        ("qa", "agreement_f1", "s-", "transcript QA: agreement with full prompt (F1, {n} transcripts)"),
    ):
        rows = sorted(report.get(workload, []), key=lambda r: r["rate"])  # the rates may have run in any order
        if rows:
            count = rows[0]["problems" if workload == "gsm8k" else "docs"]
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], style, label=label.format(n=count))
            rates.update(r["rate"] for r in rows)
    ax.set_xscale("log")
    ax.set_xticks(sorted(rates), [f"{r}x" for r in sorted(rates)])
    ax.set_xlabel("compression (original / kept prompt tokens)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Prompt compression (scorer {report['scorer']})")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
