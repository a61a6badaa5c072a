"""`carpool bench day`: the seed's day at a help desk, compressed and sent to a running server whose ledger records
it, so that `carpool cost whatif` has an operator's day to replay (issue 50's recorded day).

The day, `--seconds` long (240 by default), every request greedy with `ignore_eos` so its output is what was asked:
- the nightly classification batch: `--batch-lines` Batch API lines submitted as the day starts (a customer's
  message each, labelled billing / technical / account / other in a few tokens), which run in whatever the live
  traffic leaves;
- the help line, `priority`: every turn behind one long shared system prompt (the desk's brief and its reference
  notes, ~780 tokens of SmolLM2's), arriving as a Poisson process whose rate climbs to `--peak-rate` turns a second a third of
  the way into the day and falls back to a quarter of it; SIMPLE_SHARE of the turns are simple (a customer's
  message, SIMPLE_TOKENS out), the rest hard (a GSM8K word problem worked in HARD_TOKENS);
- long-document questions, `default`: a meeting transcript (up to `--max-doc-chars`) and a question, DOC_TOKENS
  out, at a steady `--doc-rate` a second; the transcript is one of DOC_POOL, as a team asks several questions of
  the few documents it works on.
Texts are the prompt sets shipped in carpool/bench/data (chat prompts, GSM8K, QMSum transcripts). The report:
requests and errors per kind, time to first token and between tokens p50/p99 per tier as the client saw them, and
the batch's line counts when the day ended.
"""

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from pathlib import Path

import httpx

from carpool.bench.datasets import first_human_turns, gsm8k, long_docs
from carpool.bench.serve import RequestResult, latency_summary, stream_into
from carpool.bench.trace import submit_batch

SIMPLE_SHARE = 0.7
SIMPLE_TOKENS, HARD_TOKENS, DOC_TOKENS, LABEL_TOKENS = 32, 128, 48, 4
PEAK_AT, PEAK_WIDTH, VALLEY = 1 / 3, 0.15, 0.25  # the peak's place and width as shares of the day; the floor's rate
DESK_BRIEF = (
    "You are the help desk of a mobile network operator. Answer the customer in two or three short, polite "
    "sentences; for arithmetic, show the working. The reference notes below are from the desk's last review "
    "meeting; quote them only where they answer the question.\n\nReference notes:\n"
)
LABELS = "billing, technical, account, other"
DOC_POOL = 6


def help_line_rate(t: float, seconds: float, peak_rate: float) -> float:
    """Turns a second at `t`: a morning peak on a floor of VALLEY x peak_rate."""
    bump = math.exp(-(((t / seconds - PEAK_AT) / PEAK_WIDTH) ** 2))
    return peak_rate * (VALLEY + (1 - VALLEY) * bump)


def arrivals(seconds: float, peak_rate: float, doc_rate: float, rng: random.Random) -> list[tuple[float, str]]:
    """(time, kind) of every live request of the day, in time order; kind: simple, hard or doc. The help line's
    varying rate by thinning a Poisson process at its peak rate."""
    found = []
    t = 0.0
    while peak_rate > 0 and (t := t + rng.expovariate(peak_rate)) < seconds:
        if rng.random() < help_line_rate(t, seconds, peak_rate) / peak_rate:
            found.append((t, "simple" if rng.random() < SIMPLE_SHARE else "hard"))
    t = 0.0
    while doc_rate > 0 and (t := t + rng.expovariate(doc_rate)) < seconds:
        found.append((t, "doc"))
    return sorted(found)


class Texts:
    """The day's prompts, drawn in order from the shipped sets (cycling where the day outlasts one)."""

    def __init__(self, max_doc_chars: int, rng: random.Random):
        self.rng = rng
        transcripts = list(long_docs())
        self.system = DESK_BRIEF + transcripts[0]["document"][:3200]
        self.simple = itertools.cycle(first_human_turns(max_chars=400))
        self.hard = itertools.cycle(record["question"] for record in gsm8k())
        docs = [r for r in transcripts if len(r["document"]) <= max_doc_chars]
        if not docs:
            raise ValueError(f"--max-doc-chars: no transcript is {max_doc_chars} characters or shorter")
        self.docs = docs[:DOC_POOL]
        self.questions = itertools.cycle(r["question_or_instruction"] for r in docs)
        self.labelled = itertools.cycle(first_human_turns(max_chars=300))

    def body(self, kind: str, model: str) -> dict:
        if kind == "doc":
            document = self.rng.choice(self.docs)["document"]
            messages = [
                {"role": "system", "content": "Answer from the meeting transcript the user gives."},
                {"role": "user", "content": f"{document}\n\n{next(self.questions)}"},
            ]
            tier, max_tokens = "default", DOC_TOKENS
        else:
            question = next(self.simple if kind == "simple" else self.hard)
            messages = [{"role": "system", "content": self.system}, {"role": "user", "content": question}]
            tier, max_tokens = "priority", SIMPLE_TOKENS if kind == "simple" else HARD_TOKENS
        return {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "service_tier": tier,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def label_prompt(self) -> str:
        return (
            f"Label this customer message with one of: {LABELS}. Answer with the label only.\n\n{next(self.labelled)}"
        )


async def run_day(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    schedule = arrivals(args.seconds, args.peak_rate, args.doc_rate, rng)
    texts = Texts(args.max_doc_chars, rng)
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        batch_id = None
        if args.batch_lines:
            batch_id = await submit_batch(client, model, texts.label_prompt, args.batch_lines, LABEL_TOKENS)
        bodies = [(at, kind, texts.body(kind, model)) for at, kind in schedule]
        began = time.perf_counter()

        async def one(at: float, body: dict) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - began)))
            result = RequestResult(ok=False)
            try:
                await stream_into(result, client, "/v1/chat/completions", body, time.perf_counter())
            except httpx.HTTPError as error:
                result.error = repr(error)
            return result

        results = await asyncio.gather(*(one(at, body) for at, _, body in bodies))
        span = time.perf_counter() - began
        batch = (await client.get(f"/v1/batches/{batch_id}")).json() if batch_id else None
    return report([(kind, body["service_tier"], r) for (_, kind, body), r in zip(bodies, results)], span, batch)


def report(results: list[tuple[str, str, RequestResult]], span: float, batch: dict | None) -> dict:
    kinds = sorted({kind for kind, _, _ in results})
    tiers = sorted({tier for _, tier, _ in results})
    return {
        "seconds": span,
        "requests": {kind: sum(1 for k, _, _ in results if k == kind) for kind in kinds},
        "errors": sorted({r.error for _, _, r in results if not r.ok and r.error}),
        "latency": {
            tier: latency_summary(ttft, itl)
            for tier in tiers
            for mine in [[r for _, t, r in results if t == tier and r.ok]]
            for ttft, itl in [([r.ttft for r in mine if r.ttft is not None], [g for r in mine for g in r.itls])]
        },
        "batch": None if batch is None else {"id": batch["id"], "status": batch["status"], **batch["request_counts"]},
    }


def add_parser(modes) -> None:
    parser = modes.add_parser(
        "day",
        help="send a compressed day at a help desk (a peak of priority turns behind a long system prompt, document "
        "questions, a nightly Batch API job) to a running server, whose ledger records it for carpool cost whatif",
    )
    parser.add_argument("--url", required=True, help="the server (its ledger is the day's record)")
    parser.add_argument("--seconds", type=float, default=240.0, help="the day's length (default: 240)")
    parser.add_argument("--peak-rate", type=float, default=1.2, help="help-line turns a second at the peak")
    parser.add_argument("--doc-rate", type=float, default=0.08, help="document questions a second")
    parser.add_argument("--max-doc-chars", type=int, default=5000, help="longest transcript sent (default: 5000)")
    parser.add_argument("--batch-lines", type=int, default=200, help="lines of the nightly Batch API job (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="the arrivals' and the texts' draw")
    parser.add_argument("--out", default="bench-results/day.json", help="the JSON report")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.peak_rate < 0 or args.doc_rate < 0 or args.batch_lines < 0:
        raise ValueError("--seconds must be positive; --peak-rate, --doc-rate and --batch-lines not negative")
    document = asyncio.run(run_day(args.url, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({key: document[key] for key in ("seconds", "requests", "batch")}))
    print(f"wrote {out}")
    return 0
