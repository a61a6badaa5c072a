"""`carpool bench trace`: a compressed day replayed against servers in turn, SLO controller vs fixed step sizes.

The day: a Batch API job (every line `ignore_eos`, by default more lines than any configuration finishes) is
submitted at the start (or at `--batch-at` SLICE, a nightly job) and fills whatever the interactive traffic
leaves; priority chat users (closed loop, streaming, `ignore_eos`, each one request at a time) rise to a peak and
leave, so the second half is the valley the batch fills. Time is scaled: a "minute" of the day is one slice of
`--slice-seconds` (20 s by default), and the user count changes only at slice boundaries.

Per slice: priority ITL p99 (client side, the gap between text chunks: what a user sees) against the SLO,
output tokens per second of every tier (from the server's `carpool:generation_tokens` counter), and the
machine's cost per 1M output tokens at `--hourly-price`; also the mean step token budget the server reported
(`carpool:step_token_budget`) and, under the SLO controller, its own engine-side ITL p99 and target factor
(`carpool:step_itl_p99_seconds`, `carpool:step_target_factor`): the client's p99 less the engine's is the way
from engine to client, which the controller cannot see. By default three servers run the same trace in turn: the
SLO controller (`--slo-itl-ms priority=SLO` with the large ceilings), a fixed small step and a fixed large one.
`--url NAME=URL` replays against running servers instead, `--config NAME=FLAGS` starts servers with the flags
given, and `--replicas MIN:MAX` compares replica counts under the SLO controller (carpool.bench.trace_replicas):
fixed MIN, fixed MAX, autoscaled and autoscaled with a pre-warm plan, each slice's mean serving replicas sampled
from `carpool:replicas` (the machine cost: replica-seconds). Each slice also has the priority TTFT (client side,
the request's send to its first text), judged against `--slo-ttft-ms` when it is given. A PNG per configuration
goes to `--plot-dir`.
"""

import argparse
import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from itertools import count
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from carpool.bench.datasets import first_human_turns
from carpool.bench.local_server import free_port, wait_healthy
from carpool.bench.serve import percentile
from carpool.bench.trace_replicas import add_replica_flags, replica_configurations, write_plan

# Priority users per slice: a morning ramp, the peak, then the valley (the batch job alone).
DEFAULT_USERS = (2, 6, 10, 10, 10, 6, 0, 0, 0, 0)
STARTUP_SECONDS = 300
SAMPLE_SECONDS = 0.5


@dataclass
class Configuration:
    name: str
    serve_flags: list[str] = field(default_factory=list)
    url: str | None = None  # a running server; else one is started with serve_flags
    # A pre-warmed run: its `--capacity-plan` file, written when the trace starts from the replicas the run
    # named `plan_from` had in each slice (yesterday's day, as `carpool capacity plan` would forecast it).
    plan_path: str | None = None
    plan_from: str | None = None


@dataclass
class SliceReport:
    index: int
    users: int
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    within_slo: bool | None  # ITL p99 (and TTFT p99 with --slo-ttft-ms) within; None: no priority tokens
    output_tokens_per_s: float
    priority_tokens_per_s: float
    cost_per_1m_tokens: float | None
    mean_step_token_budget: float | None
    engine_itl_p99_ms: float | None = None  # mean of the SLO controller's window p99 sampled in the slice
    mean_target_factor: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    replicas: float | None = None  # mean `carpool:replicas` sampled in the slice; None: a server without it


def add_parser(modes) -> None:
    parser = modes.add_parser(
        "trace",
        help="a compressed day (priority peak, batch valley): SLO controller vs "
        "fixed step sizes, per-slice ITL p99, tok/s and cost",
    )
    parser.add_argument(
        "--url",
        action="append",
        default=None,
        metavar="NAME=URL",
        help="replay against this running server (repeatable) instead of starting the three",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="NAME=FLAGS",
        help="start a server with these `carpool serve` flags (repeatable) instead of the three",
    )
    parser.add_argument("--model", default=None, help="model for the servers started here (default: SmolLM2-135M)")
    parser.add_argument("--slo-itl-ms", type=float, default=100.0, help="priority ITL SLO (default: 100)")
    parser.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="priority TTFT SLO a slice's p99 is judged against too (client side; the servers are not told)",
    )
    parser.add_argument(
        "--small",
        default="64:16",
        metavar="TOKENS:SEQS",
        help="the fixed small step: token budget and max sequences (default: 64:16)",
    )
    parser.add_argument(
        "--large",
        default="512:64",
        metavar="TOKENS:SEQS",
        help="the fixed large step, also the SLO controller's ceilings (default: 512:64)",
    )
    parser.add_argument(
        "--users",
        default=",".join(map(str, DEFAULT_USERS)),
        help=f"priority chat users per slice, comma-separated (default: {DEFAULT_USERS})",
    )
    parser.add_argument("--slice-seconds", type=float, default=20.0, help="one scaled 'minute' (default: 20)")
    parser.add_argument("--chat-max-tokens", type=int, default=64, help="output tokens per chat request")
    parser.add_argument("--batch-max-tokens", type=int, default=128, help="output tokens per batch line")
    parser.add_argument("--batch-lines", type=int, default=3000, help="lines in the batch job (default: 3000)")
    parser.add_argument(
        "--batch-at",
        type=int,
        default=0,
        metavar="SLICE",
        help="the slice the batch job is submitted at (default: 0, with the first users; after the peak: a "
        "nightly job)",
    )
    parser.add_argument(
        "--hourly-price",
        type=float,
        default=0.10,
        help="dollars per hour for the machine, for cost per 1M tokens (default: 0.10, a 2-vCPU cloud VM)",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="the started servers' --num-threads")
    add_replica_flags(parser)
    parser.add_argument("--out", default="bench-results/trace.json", help="where the JSON report goes")
    parser.add_argument("--plot-dir", default="docs/img", help="where trace-NAME.png goes")
    parser.set_defaults(func=main)


def parse_users(text: str) -> list[int]:
    try:
        users = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--users: expected comma-separated user counts, got {text!r}") from None
    if not users or any(u < 0 for u in users):
        raise ValueError(f"--users: counts must be >= 0, got {text!r}")
    return users


def parse_step(flag: str, text: str) -> tuple[int, int]:
    tokens, sep, seqs = text.partition(":")
    try:
        step = (int(tokens), int(seqs))
    except ValueError:
        step = (0, 0)
    if not sep or min(step) <= 0:
        raise ValueError(f"--{flag}: expected TOKENS:SEQS, two positive integers, got {text!r}")
    return step


def configurations(args: argparse.Namespace) -> list[Configuration]:
    for name in ("slo_itl_ms", "slo_ttft_ms"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if sum(bool(choice) for choice in (args.url, args.config, args.replicas)) > 1:
        raise ValueError("--url, --config and --replicas: give one of them")
    if args.replicas:
        return [Configuration(**fields) for fields in replica_configurations(args, parse_step("large", args.large))]
    if args.config:
        configs = []
        for text in args.config:
            name, sep, flags = text.partition("=")
            if not sep or not name:
                raise ValueError(f"--config: expected NAME=FLAGS, got {text!r}")
            configs.append(Configuration(name, shlex.split(flags)))
        return configs
    if args.url:
        configs = []
        for text in args.url:
            name, sep, url = text.partition("=")
            if not sep or not name or not url.startswith("http"):
                raise ValueError(f"--url: expected NAME=URL, got {text!r}")
            configs.append(Configuration(name, url=url.rstrip("/")))
        return configs
    small, large = parse_step("small", args.small), parse_step("large", args.large)

    def step(tokens_seqs):
        return ["--max-num-batched-tokens", str(tokens_seqs[0]), "--max-num-seqs", str(tokens_seqs[1])]

    return [
        Configuration("slo", [*step(large), "--slo-itl-ms", f"priority={args.slo_itl_ms:g}"]),
        Configuration(f"fixed-{small[0]}", step(small)),
        Configuration(f"fixed-{large[0]}", step(large)),
    ]


def main(args: argparse.Namespace) -> int:
    users = parse_users(args.users)
    configs = configurations(args)
    for name in ("slice_seconds", "chat_max_tokens", "batch_max_tokens", "batch_lines", "hourly_price"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.batch_at < len(users):
        raise ValueError(f"--batch-at: a slice of the trace, 0 to {len(users) - 1}, got {args.batch_at}")
    runs = []
    for config in configs:
        print(f"== {config.name}: {' '.join(config.serve_flags) or config.url}", flush=True)
        plan_from = next((run for run in runs if run["name"] == config.plan_from), None)
        slices, batch_completed = run_configuration(config, users, args, plan_from)
        for row in slices:
            print(format_slice(row), flush=True)
        runs.append(
            {
                "name": config.name,
                "serve_flags": config.serve_flags,
                "url": config.url,
                "slices": [asdict(s) for s in slices],
                "summary": {**summarize(slices, args.slice_seconds), "batch_lines_completed": batch_completed},
            }
        )
    compare(runs)
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": args.model,
        "users": users,
        "slice_seconds": args.slice_seconds,
        "slo_itl_ms": args.slo_itl_ms,
        "slo_ttft_ms": args.slo_ttft_ms,
        "hourly_price": args.hourly_price,
        "chat_max_tokens": args.chat_max_tokens,
        "batch_max_tokens": args.batch_max_tokens,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(comparison_table(runs))
    plot_dir = Path(args.plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    for run in runs:
        plot(run, report, runs, plot_dir / f"trace-{run['name']}.png")
    print(f"wrote {out} and {plot_dir}/trace-*.png")
    return 0


def run_configuration(
    config: Configuration, users: list[int], args: argparse.Namespace, plan_from: dict | None = None
) -> tuple[list[SliceReport], int | None]:
    """The configuration's slices and the Batch API lines it completed. A pre-warmed one gets its plan written as
    the trace starts, from `plan_from`'s run."""

    def on_start(unix_start: float) -> None:
        if config.plan_path:
            if plan_from is None:
                raise ValueError(f"{config.name}: its plan comes from the run {config.plan_from!r}, which has not run")
            write_plan(config.plan_path, plan_from["slices"], unix_start, args)

    if config.url:
        return asyncio.run(replay(config.url, users, args, on_start))
    port, home = free_port(), tempfile.mkdtemp(prefix="carpool-bench-trace-")
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "CARPOOL_DB": os.path.join(home, "carpool.db"),
        "CARPOOL_BATCH_DIR": os.path.join(home, "batches"),
    }
    flags = [
        *config.serve_flags,
        *(["--model", args.model] if args.model else []),
        *(["--num-threads", str(args.num_threads)] if args.num_threads else []),
    ]
    server = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), "--log-level", "warning", *flags],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        if not wait_healthy(url, server, STARTUP_SECONDS):
            raise RuntimeError(f"carpool serve {' '.join(flags)} did not become healthy")
        return asyncio.run(replay(url, users, args, on_start))
    finally:
        server.terminate()
        server.wait(60)


async def replay(
    url: str, users: list[int], args: argparse.Namespace, on_start=None
) -> tuple[list[SliceReport], int | None]:
    prompts = first_human_turns(max_chars=2000)
    tags = count()

    def next_prompt() -> str:  # tagged, so no request gets another's prefix from the cache
        tag = next(tags)
        return f"[{tag}] {prompts[tag % len(prompts)]}"

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await chat_request(client, model, next_prompt(), 4, [], 0.0)  # the first request pays one-time costs
        batch_file = await upload_batch(client, model, next_prompt, args.batch_lines, args.batch_max_tokens)
        batch_id = None
        start = time.monotonic()
        if on_start:
            on_start(time.time())
        gaps: list[tuple[float, float]] = []  # (seconds into the trace, ITL gap)
        ttfts: list[tuple[float, float]] = []  # (seconds into the trace at the first text, TTFT)
        samples: list[tuple[float, dict]] = []  # (seconds into the trace, metric values)
        stop = asyncio.Event()
        errors: list[str] = []

        def target_users() -> int:
            index = int((time.monotonic() - start) // args.slice_seconds)
            return users[index] if index < len(users) else 0

        async def user(number: int):
            while not stop.is_set():
                if number >= target_users():
                    await asyncio.sleep(0.1)
                    continue
                try:
                    await chat_request(client, model, next_prompt(), args.chat_max_tokens, gaps, start, ttfts)
                except (RuntimeError, httpx.HTTPError) as error:  # counted and shown, not the end of the run
                    errors.append(repr(error))
                    await asyncio.sleep(0.5)

        async def batch_job():
            nonlocal batch_id
            await asyncio.sleep(args.batch_at * args.slice_seconds)
            batch_id = await create_batch(client, batch_file)

        async def sampler():
            while not stop.is_set():
                samples.append((time.monotonic() - start, await scrape(client)))
                await asyncio.sleep(SAMPLE_SECONDS)

        tasks = [asyncio.create_task(user(n)) for n in range(max(users))] + [asyncio.create_task(sampler())]
        tasks.append(asyncio.create_task(batch_job()))
        await asyncio.sleep(len(users) * args.slice_seconds)
        samples.append((time.monotonic() - start, await scrape(client)))
        stop.set()
        batch_completed = None
        if batch_id is not None:
            batch_completed = (await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"]
            await client.post(f"/v1/batches/{batch_id}/cancel")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if errors:
        print(f"  {len(errors)} chat requests failed, e.g. {errors[0]}", flush=True)
    slices = slice_reports(
        users, args.slice_seconds, gaps, samples, args.slo_itl_ms, args.hourly_price, ttfts, args.slo_ttft_ms
    )
    return slices, batch_completed


async def chat_request(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, gaps: list, start: float, ttfts=None
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "service_tier": "priority",
        "ignore_eos": True,
    }
    sent, last = time.monotonic(), None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat request: HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or '"content"' not in line:
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append((now - start, now - last))
            elif ttfts is not None:
                ttfts.append((now - start, now - sent))
            last = now


async def upload_batch(client: httpx.AsyncClient, model: str, next_prompt, lines: int, max_tokens: int) -> str:
    """The batch job's input file, uploaded ahead (the upload is no part of the trace); its file id."""
    data = "".join(
        json.dumps(
            {
                "custom_id": f"trace-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": next_prompt()}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )
        + "\n"
        for i in range(lines)
    ).encode()
    uploaded = await client.post("/v1/files", files={"file": ("trace.jsonl", data)}, data={"purpose": "batch"})
    uploaded.raise_for_status()
    return uploaded.json()["id"]


async def submit_batch(client: httpx.AsyncClient, model: str, next_prompt, lines: int, max_tokens: int) -> str:
    """A batch job of `lines` chat requests, uploaded and created; its id."""
    return await create_batch(client, await upload_batch(client, model, next_prompt, lines, max_tokens))


async def create_batch(client: httpx.AsyncClient, file_id: str) -> str:
    batch = await client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    )
    batch.raise_for_status()
    return batch.json()["id"]


async def scrape(client: httpx.AsyncClient) -> dict:
    return metric_values((await client.get("/metrics")).text)


def metric_values(text: str) -> dict:
    """Output tokens so far (all tiers, and priority), the step token budget, the SLO controller's gauges and the
    serving replicas (None: a server without replicas), from Prometheus text."""
    values = {
        "tokens": 0.0,
        "priority_tokens": 0.0,
        "step_token_budget": None,
        "step_itl_p99_seconds": None,
        "step_target_factor": None,
        "replicas": None,
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "carpool:generation_tokens_total":
                values["tokens"] += sample.value
                if sample.labels.get("tier") == "priority":
                    values["priority_tokens"] += sample.value
            elif sample.name in (
                "carpool:step_token_budget",
                "carpool:step_itl_p99_seconds",
                "carpool:step_target_factor",
            ):
                values[sample.name.removeprefix("carpool:")] = sample.value
            elif sample.name == "carpool:replicas":
                values["replicas"] = (values["replicas"] or 0.0) + sample.value
    return values


def slice_reports(
    users: list[int],
    slice_seconds: float,
    gaps: list,
    samples: list,
    slo_ms: float,
    hourly_price: float,
    ttfts: list = (),
    slo_ttft_ms: float | None = None,
) -> list[SliceReport]:
    reports = []
    for index, count_ in enumerate(users):
        begin, end = index * slice_seconds, (index + 1) * slice_seconds
        itls = [gap * 1000 for at, gap in gaps if begin <= at < end]
        firsts = [ttft * 1000 for at, ttft in ttfts if begin <= at < end]
        first, last = _sample_at(samples, begin), _sample_at(samples, end)
        seconds = max(last[0] - first[0], 1e-9)
        tok_s = (last[1]["tokens"] - first[1]["tokens"]) / seconds
        in_slice = [v for at, v in samples if begin <= at < end]
        budgets = [v["step_token_budget"] for v in in_slice if v["step_token_budget"]]
        engine_p99s = [v["step_itl_p99_seconds"] * 1000 for v in in_slice if v.get("step_itl_p99_seconds")]
        factors = [v["step_target_factor"] for v in in_slice if v.get("step_target_factor")]
        replicas = [v["replicas"] for v in in_slice if v.get("replicas") is not None]
        p99, ttft_p99 = percentile(itls, 99), percentile(firsts, 99)
        within = None if p99 is None else p99 <= slo_ms
        if within and slo_ttft_ms is not None:
            within = ttft_p99 is not None and ttft_p99 <= slo_ttft_ms
        reports.append(
            SliceReport(
                index=index,
                users=count_,
                itl_p50_ms=percentile(itls, 50),
                itl_p99_ms=p99,
                within_slo=within,
                output_tokens_per_s=tok_s,
                priority_tokens_per_s=(last[1]["priority_tokens"] - first[1]["priority_tokens"]) / seconds,
                cost_per_1m_tokens=hourly_price / 3600 / tok_s * 1e6 if tok_s > 0 else None,
                mean_step_token_budget=sum(budgets) / len(budgets) if budgets else None,
                engine_itl_p99_ms=sum(engine_p99s) / len(engine_p99s) if engine_p99s else None,
                mean_target_factor=sum(factors) / len(factors) if factors else None,
                ttft_p50_ms=percentile(firsts, 50),
                ttft_p99_ms=ttft_p99,
                replicas=sum(replicas) / len(replicas) if replicas else None,
            )
        )
    return reports


def _sample_at(samples: list, at: float) -> tuple:
    """The sample taken closest to `at` seconds into the trace."""
    return min(samples, key=lambda sample: abs(sample[0] - at))


def summarize(slices: list[SliceReport], slice_seconds: float) -> dict:
    peak = [s for s in slices if s.users > 0 and s.within_slo is not None]
    tok_s = sum(s.output_tokens_per_s for s in slices) / len(slices)
    sampled = [s.replicas for s in slices if s.replicas is not None]
    return {
        # The machine cost of a replicated server: serving replicas over the trace (a starting one not yet in).
        "replica_seconds": sum(sampled) * slice_seconds if len(sampled) == len(slices) else None,
        "peak_slices": len(peak),
        "peak_slices_within_slo": sum(s.within_slo for s in peak),
        "peak_share_within_slo": sum(s.within_slo for s in peak) / len(peak) if peak else None,
        "mean_output_tokens_per_s": tok_s,
    }


def compare(runs: list[dict]) -> None:
    """Each run's throughput against the best fixed configuration's (the others, when none is fixed)."""
    for run in runs:
        others = [r for r in runs if r is not run and r["name"].startswith("fixed")] or [
            r for r in runs if r is not run
        ]
        best = max((r["summary"]["mean_output_tokens_per_s"] for r in others), default=None)
        run["summary"]["throughput_vs_best_other"] = run["summary"]["mean_output_tokens_per_s"] / best if best else None


def format_slice(s: SliceReport) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    verdict = "" if s.within_slo is None else ("ok" if s.within_slo else "missed")
    cost = "-" if s.cost_per_1m_tokens is None else f"${s.cost_per_1m_tokens:.3f}"
    budget = "-" if s.mean_step_token_budget is None else f"{s.mean_step_token_budget:.0f}"
    controller = (
        ""
        if s.engine_itl_p99_ms is None
        else f"  engine p99 {s.engine_itl_p99_ms:.0f} ms factor {s.mean_target_factor or 1:.2f}"
    )
    replicas = "" if s.replicas is None else f"replicas {s.replicas:4.2f}  "
    return (
        f"  min {s.index:>2} users {s.users:>2}  {replicas}ITL p50 {ms(s.itl_p50_ms):>4} p99 {ms(s.itl_p99_ms):>5} "
        f"ms TTFT p50 {ms(s.ttft_p50_ms):>5} p99 {ms(s.ttft_p99_ms):>5} ms {verdict:<9} "
        f"out {s.output_tokens_per_s:6.1f} tok/s (priority {s.priority_tokens_per_s:5.1f})  "
        f"{cost}/1M  step budget {budget}{controller}"
    )


def comparison_table(runs: list[dict]) -> str:
    header = f"{'configuration':<14}{'peak min in SLO':>16}{'mean out tok/s':>16}{'vs best other':>14}"
    lines = [header + f"{'replica-s':>11}{'batch lines':>13}"]
    for run in runs:
        s = run["summary"]
        share = (
            "-"
            if s["peak_share_within_slo"] is None
            else f"{s['peak_slices_within_slo']}/{s['peak_slices']} ({s['peak_share_within_slo']:.0%})"
        )
        ratio = "-" if s["throughput_vs_best_other"] is None else f"{s['throughput_vs_best_other']:.2f}x"
        replica_s = "-" if s.get("replica_seconds") is None else f"{s['replica_seconds']:.0f}"
        batch = "-" if s.get("batch_lines_completed") is None else str(s["batch_lines_completed"])
        lines.append(
            f"{run['name']:<14}{share:>16}{s['mean_output_tokens_per_s']:>16.1f}{ratio:>14}{replica_s:>11}{batch:>13}"
        )
    return "\n".join(lines)


def plot(run: dict, report: dict, runs: list[dict], path: Path) -> None:
    """ITL p99 per slice against the SLO, and output tok/s, on the same axes limits for every configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slice_s = report["slice_seconds"]
    itl_top = max([s["itl_p99_ms"] or 0 for r in runs for s in r["slices"]] + [report["slo_itl_ms"]]) * 1.1
    tok_top = max(s["output_tokens_per_s"] for r in runs for s in r["slices"]) * 1.1 or 1
    x = [s["index"] for s in run["slices"]]
    figure, (itl, tok) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    itl.plot(x, [s["itl_p99_ms"] for s in run["slices"]], marker="o", color="C3", label="priority ITL p99")
    engine = [s.get("engine_itl_p99_ms") for s in run["slices"]]
    if any(value is not None for value in engine):
        itl.plot(
            x,
            [math.nan if value is None else value for value in engine],
            marker=".",
            linestyle=":",
            color="C2",
            label="engine-side p99 (controller's window)",
        )
    itl.axhline(report["slo_itl_ms"], linestyle="--", color="k", label=f"SLO {report['slo_itl_ms']:g} ms")
    itl.set(
        ylabel="ms (log)",
        yscale="log",
        ylim=(5, itl_top),
        title=f"{run['name']}: {' '.join(run['serve_flags']) or run['url']}",
    )
    users = itl.twinx()
    users.step(x, [s["users"] for s in run["slices"]], where="mid", color="C7", alpha=0.5, label="priority users")
    if any(s.get("replicas") is not None for s in run["slices"]):
        serving = [math.nan if s.get("replicas") is None else s["replicas"] for s in run["slices"]]
        users.step(x, serving, where="mid", color="C4", label="serving replicas (mean)")
        users.legend(fontsize=8, loc="upper left")
    users.set(ylabel="priority users / replicas", ylim=(0, max(report["users"]) * 1.2 or 1))
    tok.bar(x, [s["output_tokens_per_s"] for s in run["slices"]], color="C0", label="all tiers")
    tok.bar(x, [s["priority_tokens_per_s"] for s in run["slices"]], color="C1", label="priority")
    tok.set(ylabel="output tok/s", ylim=(0, tok_top), xlabel=f"minute of the day (1 minute = {slice_s:g} s)")
    for axis in (itl, tok):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
