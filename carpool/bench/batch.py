"""`carpool bench batch`: does batch work stay out of interactive traffic's way, and does it still get done?

One run, three phases on one server (started here, with a ledger of its own):
  1. interactive alone: N clients in a closed loop of streaming chat requests at the priority tier -> TTFT;
  2. the batch alone: a Batch API job of P prompts with nothing else running -> the engine's throughput;
  3. both: the same clients while a second batch of P prompts runs -> TTFT under batch load, batch throughput.
Then the ledger's cost per 1M tokens for each tier that ran. Every request generates exactly its max_tokens
(`ignore_eos`), and every prompt is tagged with a unique number, so no phase gets prefix-cache hits from another.
Targets: interactive TTFT p99 rises by at most 25% while the batch runs; the batch keeps at least 80% of the
throughput it had alone.
"""

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from itertools import count
from pathlib import Path

from carpool.bench.datasets import first_human_turns
from carpool.bench.serve import percentile
from carpool.engine.args import add_engine_args, engine_config

TTFT_P99_RISE_TARGET = 0.25
BATCH_THROUGHPUT_TARGET = 0.80
POLL_SECONDS = 0.25


@dataclass
class InteractiveReport:
    requests: int
    errors: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None


@dataclass
class BatchReport:
    requests: int
    failed: int
    seconds: float
    output_tokens: int
    output_tokens_per_s: float


def add_parser(modes) -> None:
    parser = modes.add_parser("batch", help="batch throughput and interactive TTFT, alone and together")
    parser.add_argument("--num-prompts", type=int, default=500, help="requests in each batch")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per batch request")
    parser.add_argument("--clients", type=int, default=4, help="interactive clients, each one request at a time")
    parser.add_argument(
        "--interactive-requests", type=int, default=16, help="requests per client in the interactive-alone phase"
    )
    parser.add_argument("--interactive-max-tokens", type=int, default=16, help="output tokens per interactive request")
    parser.add_argument("--max-prompt-chars", type=int, default=2000, help="skip longer prompts")
    parser.add_argument("--out", default="bench-results/batch.json", help="where the JSON report goes")
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: main(args, engine_config(args)))


def main(args: argparse.Namespace, config) -> int:
    from carpool.bench.local_server import LocalServer

    for name in ("num_prompts", "max_tokens", "clients", "interactive_requests", "interactive_max_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    with (
        tempfile.TemporaryDirectory(prefix="carpool-bench-batch-") as workdir,
        LocalServer(config, Path(workdir)) as server,
    ):
        report = asyncio.run(run(args, server))
        report["cost_per_1m_tokens"] = {row.group: row.cost_per_1k_tokens * 1000 for row in server.gate.usage("tier")}
    report["engine"] = asdict(config)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"\nwrote {path}")
    return 0


async def run(args: argparse.Namespace, server) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=3600)
    prompts = first_human_turns(max_chars=args.max_prompt_chars)
    if not prompts:
        raise ValueError("no prompts to run: raise --max-prompt-chars")
    tags = count()

    def next_prompt() -> str:
        tag = next(tags)
        return f"[{tag}] {prompts[tag % len(prompts)]}"

    chat = Interactive(client, server.model, args.interactive_max_tokens, next_prompt)
    await chat.request()  # warm-up
    alone = await chat.closed_loop(args.clients, lambda done: done >= args.interactive_requests)
    print(f"interactive alone: TTFT p99 {_ms(alone.ttft_p99_s)} ms", flush=True)

    batch_alone = await run_batch(client, server.model, args, next_prompt)
    print(f"batch alone: {batch_alone.output_tokens_per_s:.1f} output tokens/s", flush=True)

    finished = asyncio.Event()
    loop = asyncio.create_task(chat.closed_loop(args.clients, lambda done: finished.is_set()))
    try:
        batch_mixed = await run_batch(client, server.model, args, next_prompt)
    finally:
        finished.set()
    mixed = await loop
    print(
        f"together: TTFT p99 {_ms(mixed.ttft_p99_s)} ms, batch {batch_mixed.output_tokens_per_s:.1f} tok/s", flush=True
    )
    return {
        "model": server.model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "clients": args.clients,
        "interactive_max_tokens": args.interactive_max_tokens,
        "interactive_alone": asdict(alone),
        "interactive_with_batch": asdict(mixed),
        "batch_alone": asdict(batch_alone),
        "batch_with_interactive": asdict(batch_mixed),
        "ttft_p99_rise": _ratio(mixed.ttft_p99_s, alone.ttft_p99_s) - 1,
        "batch_throughput_kept": _ratio(batch_mixed.output_tokens_per_s, batch_alone.output_tokens_per_s),
    }


class Interactive:
    """Streaming chat at the priority tier; TTFT runs to the first chunk carrying text."""

    def __init__(self, client, model: str, max_tokens: int, next_prompt):
        self.client, self.model, self.max_tokens, self.next_prompt = client, model, max_tokens, next_prompt

    async def request(self) -> float | None:
        start = time.perf_counter()
        stream = await self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": self.next_prompt()}],
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            service_tier="priority",
            extra_body={"ignore_eos": True},
        )
        ttft = None
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
        return ttft

    async def closed_loop(self, clients: int, stop) -> InteractiveReport:
        """`clients` loops of one request at a time, each until stop(requests it has made) is true."""
        ttfts, errors = [], 0

        async def one_client():
            nonlocal errors
            done = 0
            while not stop(done):
                try:
                    ttft = await self.request()
                except Exception:  # a refused or broken request counts as an error, not a crash of the bench
                    errors += 1
                else:
                    if ttft is not None:
                        ttfts.append(ttft)
                done += 1

        await asyncio.gather(*(one_client() for _ in range(clients)))
        return InteractiveReport(len(ttfts) + errors, errors, percentile(ttfts, 50), percentile(ttfts, 99))


async def run_batch(client, model: str, args: argparse.Namespace, next_prompt) -> BatchReport:
    lines = [
        {
            "custom_id": f"p{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": next_prompt()}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(args.num_prompts)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    start = time.perf_counter()
    uploaded = await client.files.create(file=("bench.jsonl", data), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(POLL_SECONDS)
        batch = await client.batches.retrieve(batch.id)
    seconds = time.perf_counter() - start
    if batch.status != "completed":
        raise RuntimeError(f"the benchmark's batch ended {batch.status}: {batch.errors}")
    tokens = batch.usage.output_tokens
    return BatchReport(batch.request_counts.total, batch.request_counts.failed, seconds, tokens, tokens / seconds)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


def table(report: dict) -> str:
    alone, mixed = report["interactive_alone"], report["interactive_with_batch"]
    batch_alone, batch_mixed = report["batch_alone"], report["batch_with_interactive"]
    kept = report["batch_throughput_kept"]
    lines = [
        (
            f"{report['model']}: batch of {report['num_prompts']} x {report['max_tokens']} tokens, "
            f"{report['clients']} priority clients x {report['interactive_max_tokens']} tokens"
        ),
        f"{'':<26}{'requests':>9}{'TTFT p50':>10}{'TTFT p99':>10}   (ms)",
        *(
            f"{name:<26}{phase['requests']:>9}{_ms(phase['ttft_p50_s']):>10}{_ms(phase['ttft_p99_s']):>10}"
            for name, phase in (("interactive alone", alone), ("interactive + batch", mixed))
        ),
        f"TTFT p99 rise: {_percent(report['ttft_p99_rise'])} (target <= +{TTFT_P99_RISE_TARGET:.0%})",
        f"{'':<26}{'requests':>9}{'seconds':>10}{'out tok/s':>10}",
        (
            f"{'batch alone':<26}{batch_alone['requests']:>9}{batch_alone['seconds']:>10.1f}"
            f"{batch_alone['output_tokens_per_s']:>10.1f}"
        ),
        (
            f"{'batch + interactive':<26}{batch_mixed['requests']:>9}{batch_mixed['seconds']:>10.1f}"
            f"{batch_mixed['output_tokens_per_s']:>10.1f}"
        ),
        f"batch throughput kept: {'-' if kept is None else f'{kept:.0%}'} (target >= {BATCH_THROUGHPUT_TARGET:.0%})",
        "cost per 1M tokens (ledger): "
        + ", ".join(f"{tier} ${cost:.4f}" for tier, cost in sorted(report["cost_per_1m_tokens"].items())),
    ]
    return "\n".join(lines)
