"""`carpool cost whatif`: the operator's own recorded traffic (the ledger's rows: arrival, tier, tenant, prompt
length and its salted block-hash chain, output tokens) replayed through the replica simulator
(carpool.bench.simulate, fitted to this machine's measured steps) under each lever alone and all together, priced
by the price sheet and the machine's hourly price. For each: the machine's cost (replicas x hourly price x the
time the traffic spans, idle time included: machines are paid by the hour), the revenue the sheet bills,
the margin and its change against today's configuration, TTFT and ITL p50/p99 per tier.

The levers replayed here: prefix caching off (today's saving made visible), cache breakpoints on the shared
prefixes (pinned for a TTL, their writes at its rate), chosen tenants' or tiers' requests moved to the Batch API
(half price, admitted after every live tier; the report says how long they waited against the 24-hour window),
prompt compression at a rate, a router or a cascade through a cheaper model (its replica and step model of its
own; the share routed or escalated from `carpool cascade evaluate`), the SLO controller (the engine's own,
carpool.engine.slo, fed the simulated steps) against today's fixed steps, fixed steps of another token budget, and
replica counts.

Compression is replayed as the server runs it (carpool.server.compression): the scorer's pass over the whole prompt
(a prompt computed with its cache hits, one token out, billed as its own row), then the request with its prompt
cut to the rate. What every compressed prompt keeps verbatim is its shared prefix (the leading blocks it shares with
another recorded prompt: a system prompt, protected), so that prefix stays a cache hit; the rest is new text.

A row written before the ledger kept `arrived` has no place in a replay: such rows are counted and left out.
"""

import argparse
import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from carpool.bench.serve import latency_summary
from carpool.bench.simulate import Job, Pool, ReplicaSpec, SimResult, StepModel, measure_step_model, replay
from carpool.economics.contract import UsageRecord, read_block_chain
from carpool.economics.db import default_db_path, open_database
from carpool.economics.prices import PriceSheet, load_price_sheet
from carpool.economics.reports import parse_time
from carpool.engine.tiers import BATCH_TIER, TIER_NAMES
from carpool.server.assembly import slo_flag
from carpool.server.step_log import read_steps

BATCH_WINDOW_SECONDS = 24 * 3600  # the Batch API's completion window
FIVE_MINUTES = 300
BREAKPOINT_TTLS = {"5m": FIVE_MINUTES, "1h": 3600}  # Anthropic's cache_control TTLs
# Replays of each scenario with a spread around the step model. One draw of step times is one possible day: on the
# help-desk day's 15 document questions, eight single draws put their TTFT p50 between 72 and 118 ms, where the real
# run's was 110 (docs/benchmarks/journal.md, 2026-12-07); their median is the day to expect, not one of them.
DRAWS = 8


@dataclass(frozen=True)
class Recorded:
    """One ledger row as a replay needs it."""

    job: Job
    tenant: str | None
    model: str
    billed: float  # what the ledger billed it
    ttft: float = 0.0  # its queue and prefill seconds in the ledger: the engine's time to its first token


@dataclass(frozen=True)
class Scenario:
    name: str
    replicas: int
    prefix_caching: bool = True
    to_batch: frozenset = frozenset()  # indexes of the rows moved to the Batch API
    compressed: frozenset = frozenset()  # indexes of the rows whose prompts are compressed to compress_rate
    compress_rate: float = 1.0
    breakpoint_ttl: float = 0.0  # seconds a cache breakpoint pins each prompt's shared prefix; 0: no breakpoints
    slo_itl_ms: tuple = ()  # (tier, ms) pairs: the SLO controller sizes each step; none: fixed steps
    slo_ttft_ms: tuple = ()
    step_tokens: int | None = None  # fixed steps of this many tokens (`carpool serve --max-num-batched-tokens`)
    # A cheaper model on a replica of its own: a router sends it the `routed` rows; a cascade tries every row on
    # it first and sends the `escalated` ones on to the recorded model after.
    cheap_model: str | None = None
    routed: frozenset = frozenset()
    cascade: bool = False
    escalated: frozenset = frozenset()


def recorded_rows(db, model: str | None, since: float | None, until: float | None) -> tuple[list[Recorded], int]:
    """(the rows of `model` (default: the one with most rows) in [since, until) that a replay can use, the
    number left out for lacking an arrival time)."""
    conn = open_database(db)
    try:
        bounds = (since if since is not None else float("-inf"), until if until is not None else float("inf"))
        if model is None:
            found = conn.execute(
                "SELECT model FROM ledger WHERE time >= ? AND time < ? GROUP BY model ORDER BY COUNT(*) DESC",
                bounds,
            ).fetchone()
            if found is None:
                raise ValueError("--db: the ledger has no rows in that window")
            model = found[0]
        rows = conn.execute(
            "SELECT arrived, tier, tenant, uncached_prompt_tokens + cache_read_tokens, output_tokens,"
            " prompt_block_chain, cost, queue_seconds + prefill_seconds FROM ledger"
            " WHERE model = ? AND time >= ? AND time < ? ORDER BY arrived",
            (model, *bounds),
        ).fetchall()
    finally:
        conn.close()
    usable = [row for row in rows if row[0] is not None]
    recorded = []
    for arrived, tier, tenant, prompt_tokens, output_tokens, chain_text, billed, ttft in usable:
        chains = read_block_chain(chain_text)
        job = Job(arrived, max(prompt_tokens, 1), tuple(chains[0]) if chains else (), output_tokens, tier)
        recorded.append(Recorded(job, tenant, model, billed, ttft))
    return recorded, len(rows) - len(usable)


def scenarios(rows: list[Recorded], args: argparse.Namespace) -> list[Scenario]:
    """Today, each lever alone, and all of them together."""
    today = Scenario("today", args.replicas_today)
    moved = frozenset(
        i for i, row in enumerate(rows) if row.tenant in args.batch_tenants or row.job.tier in args.batch_tiers
    )
    compressed = frozenset(
        i
        for i, row in enumerate(rows)
        if args.compress_rate is not None and row.job.prompt_tokens >= args.compress_min_tokens
    )
    found = [today, replace(today, name="no prefix cache", prefix_caching=False)]
    if moved:
        found.append(replace(today, name=f"Batch API ({len(moved)} moved)", to_batch=moved))
    for flag, (model, share) in (("router", args.router), ("cascade", args.cascade)):
        if model is None:
            continue
        rng = random.Random(0)  # which rows: a fixed draw, so every run of a report picks the same
        picked = frozenset(i for i in range(len(rows)) if rng.random() < share)
        if flag == "router":
            found.append(replace(today, name=f"router to {model} ({len(picked)})", cheap_model=model, routed=picked))
        else:
            name = f"cascade via {model} ({len(picked)} escalated)"
            found.append(replace(today, name=name, cheap_model=model, cascade=True, escalated=picked))
    for ttl in args.breakpoint_ttl:
        found.append(replace(today, name=f"breakpoints {ttl}", breakpoint_ttl=BREAKPOINT_TTLS[ttl]))
    if compressed:
        rate = args.compress_rate
        found.append(
            replace(today, name=f"compress to {rate:g} ({len(compressed)})", compressed=compressed, compress_rate=rate)
        )
    itl, ttft = tuple(slo_flag(args, "slo_itl_ms").items()), tuple(slo_flag(args, "slo_ttft_ms").items())
    if itl or ttft:
        targets = ", ".join(
            f"{tier} {kind} {ms:g} ms" for kind, pairs in (("ITL", itl), ("TTFT", ttft)) for tier, ms in pairs
        )
        found.append(replace(today, name=f"SLO steps ({targets})", slo_itl_ms=itl, slo_ttft_ms=ttft))
    found += [
        replace(today, name=f"steps of {n} tokens", step_tokens=n)
        for n in args.step_tokens
        if n != args.max_num_batched_tokens
    ]
    found += [replace(today, name=f"{n} replicas", replicas=n) for n in args.replicas if n != args.replicas_today]
    if (moved or compressed) and args.replicas:
        fewest = min(args.replicas)
        levers = " + ".join(name for name, used in (("Batch API", moved), ("compression", compressed)) if used)
        found.append(
            replace(
                today,
                name=f"{levers} + {fewest} replicas",
                replicas=fewest,
                to_batch=moved,
                compressed=compressed,
                compress_rate=args.compress_rate or 1.0,
            )
        )
    return found


def scenario_jobs(
    scenario: Scenario, rows: list[Recorded], block_size: int, min_pin_tokens: int
) -> tuple[list[Job], list[str]]:
    """The jobs a scenario replays (arrivals from 0) and each one's model: a row each, in their order, then the
    compressed rows' requests, each sent after its row's scorer pass (which the row's own job becomes). Under
    breakpoints, each prompt's shared prefix of at least `min_pin_tokens` tokens is pinned, as the engine pins a
    breakpoint's (shorter ones are cached as any prefix)."""
    start = min(row.job.arrival for row in rows)
    shared = _shared_blocks(rows) if scenario.compressed or scenario.breakpoint_ttl else frozenset()
    jobs, followers = [], []
    for i, row in enumerate(rows):
        tier = BATCH_TIER if i in scenario.to_batch else row.job.tier
        job = replace(row.job, arrival=row.job.arrival - start, tier=tier)
        kept = list(itertools.takewhile(lambda block: block in shared, job.chain))
        if scenario.breakpoint_ttl and len(kept) * block_size >= min_pin_tokens:
            job = replace(job, pinned_blocks=len(kept), pin_ttl=scenario.breakpoint_ttl)
        if scenario.cascade:
            jobs.append(replace(job, model=1, internal=i in scenario.escalated))  # the cheap attempt
            if i in scenario.escalated:
                followers.append(replace(job, after=i))
            continue
        if i in scenario.routed:
            job = replace(job, model=1)
        if i not in scenario.compressed:
            jobs.append(job)
            continue
        jobs.append(replace(job, output_tokens=1, internal=True))  # the scorer's pass: prompt logprobs, one step
        rest = job.prompt_tokens - len(kept) * block_size
        cut = max(1, math.floor(scenario.compress_rate * rest))
        fresh = tuple(("compressed", i, k) for k in range(cut // block_size))
        followers.append(replace(job, prompt_tokens=len(kept) * block_size + cut, chain=(*kept, *fresh), after=i))
    jobs += followers
    recorded = [rows[i if job.after is None else job.after].model for i, job in enumerate(jobs)]
    return jobs, [scenario.cheap_model if job.model else model for job, model in zip(jobs, recorded)]


def _shared_blocks(rows: list[Recorded]) -> frozenset:
    """Blocks in more than one recorded prompt's chain."""
    seen: set = set()
    shared: set = set()
    for row in rows:
        for block in set(row.job.chain):
            (shared if block in seen else seen).add(block)
    return frozenset(shared)


def run_scenario(
    scenario: Scenario,
    rows: list[Recorded],
    step: StepModel,
    spec: ReplicaSpec,
    hourly: float,
    prices: PriceSheet,
    cheap_step: StepModel | None = None,
    draws: int = 1,
) -> dict:
    """The scenario replayed `draws` times, each with its own draw of step times around the step model: the money
    (span, revenue, hit rate) is the draws' mean, each latency percentile the draws' median of their own."""
    jobs, models = scenario_jobs(scenario, rows, spec.block_size, prices.cache_min_tokens)
    spec = replace(
        spec,
        prefix_caching=scenario.prefix_caching,
        slo_itl_ms=dict(scenario.slo_itl_ms),
        slo_ttft_ms=dict(scenario.slo_ttft_ms),
        max_num_batched_tokens=scenario.step_tokens or spec.max_num_batched_tokens,
    )
    others = (Pool(1, cheap_step),) if scenario.cheap_model else ()
    spread = step.noise or (cheap_step is not None and cheap_step.noise)  # without one, every draw is the same
    results = [
        replay(jobs, scenario.replicas, "prefix", step, spec, others, draw) for draw in range(draws if spread else 1)
    ]
    last_arrival = max(job.arrival for job in jobs)
    span = float(np.mean([max(last_arrival, result.makespan) for result in results]))
    replicas = scenario.replicas + len(others)
    machine = replicas * hourly * span / 3600
    revenue = float(np.mean([_revenue(prices, models, jobs, result) for result in results]))
    # Per 1M tokens the client sent and received: a compressed request's are its original prompt and its output.
    tokens = sum(row.job.prompt_tokens + row.job.output_tokens for row in rows)
    last_job = {job.after: i for i, job in enumerate(jobs) if job.after is not None}  # a compressed row's request
    waited = [
        at - jobs[i].arrival
        for result in results
        for i in scenario.to_batch
        if (at := result.finished_by_job.get(last_job.get(i, i))) is not None
    ]
    prompt = sum(result.prompt_tokens for result in results)
    cached = sum(result.cached_tokens for result in results)
    latency = {
        tier: _median_summary(
            [latency_summary(r.ttft_by_tier.get(tier, []), r.itl_by_tier.get(tier, [])) for r in results]
        )
        for tier in TIER_NAMES
        if any(tier in result.ttft_by_tier for result in results)
    }
    return {
        "scenario": scenario.name,
        "replicas": replicas,
        "prefix_caching": scenario.prefix_caching,
        "moved_to_batch": len(scenario.to_batch),
        "compressed": len(scenario.compressed),
        "prompt_tokens_computed": (prompt - cached) / len(results),
        "seconds": span,
        "machine_cost": machine,
        "machine_cost_per_1m_tokens": machine / tokens * 1e6 if tokens else 0.0,
        "revenue": revenue,
        "margin": revenue - machine,
        "hit_rate": cached / prompt if prompt else 0.0,
        "batch_longest_wait_s": max(waited, default=None),
        "batch_within_window": all(wait <= BATCH_WINDOW_SECONDS for wait in waited),
        "latency": latency,
    }


def _median_summary(summaries: list[dict]) -> dict:
    """Each latency figure's median over the draws' own: what one day's percentile is expected to be. Pooling the
    draws' latencies instead gives another statistic: on the help-desk day one cold request is 1 of a tier's 87, so
    one day's p99 falls between it and the next, where 8 draws pooled put the p99 on it: 1.4-3.6x the real
    runs' in all seven runs with the cache on (2026-12-07 00:30)."""
    return {
        key: float(np.median(values)) if (values := [s[key] for s in summaries if s[key] is not None]) else None
        for key in summaries[0]
    }


def _revenue(prices: PriceSheet, models: list[str], jobs: list[Job], result: SimResult) -> float:
    """What the sheet bills the replayed jobs, with the cache hits and writes this replay found or made."""
    return sum(
        _billed(
            prices,
            model,
            job,
            result.cached_by_job.get(i, 0),
            result.cache_writes_by_job.get(i, 0),
            result.pin_writes_by_job.get(i, 0),
        )
        for i, (model, job) in enumerate(zip(models, jobs, strict=True))
    )


def _billed(
    prices: PriceSheet, model: str, job: Job, cached_tokens: int, cache_write_tokens: int, pin_write_tokens: int
) -> float:
    """What the price sheet bills a replayed request: its tier, its prompt with the cache hits it got and the
    blocks it added to the cache, those under its breakpoint at the TTL's write rate (5 minutes or less: `write`,
    longer: `write_1h`)."""
    usage = UsageRecord(
        request_id="whatif",
        model=model,
        tier=job.tier,
        prompt_tokens=job.prompt_tokens,
        cached_tokens=cached_tokens,
        cache_write_tokens=cache_write_tokens,
        cache_write_5m_tokens=pin_write_tokens if job.pin_ttl <= FIVE_MINUTES else 0,
        cache_write_1h_tokens=pin_write_tokens if job.pin_ttl > FIVE_MINUTES else 0,
        output_tokens=job.output_tokens,
        queue_seconds=0.0,
        prefill_seconds=0.0,
        decode_seconds=0.0,
        finish_reason="stop",
    )
    return prices.cost(usage)


def admission_delay(rows: list[Recorded], replicas: int, step: StepModel, spec: ReplicaSpec) -> float:
    """The time from arrival to scheduling the step model leaves out (HTTP, the engine loop picking the request
    up, the admission's own work): the median of each recorded row's own time to first token less the one today's
    replay gives it, not below 0. On the help-desk day the replay without it put the priority turns' TTFT p50 15-27%
    under the real runs' in every lever tried (docs/benchmarks/journal.md, 2026-12-06 11:51)."""
    jobs, _ = scenario_jobs(Scenario("today", replicas), rows, spec.block_size, 0)
    simulated = replay(jobs, replicas, "prefix", step, spec).ttft_by_job
    residuals = [row.ttft - simulated[i] for i, row in enumerate(rows) if row.ttft > 0 and i in simulated]
    return max(0.0, float(np.median(residuals))) if residuals else 0.0


def whatif(
    rows: list[Recorded], args: argparse.Namespace, step: StepModel, cheap_step: StepModel | None = None
) -> tuple[list[dict], float]:
    """Every scenario's report, and the admission delay fitted to the rows (admission_delay) they all ran with."""
    spec = ReplicaSpec(args.max_num_seqs, args.max_num_batched_tokens, args.num_kv_blocks)
    spec = replace(spec, admission_seconds=admission_delay(rows, args.replicas_today, step, spec))
    prices = load_price_sheet(args.prices)
    results = [
        run_scenario(s, rows, step, spec, args.hourly_price, prices, cheap_step, args.draws)
        for s in scenarios(rows, args)
    ]
    for result in results:
        result["margin_change"] = result["margin"] - results[0]["margin"]
    return results, spec.admission_seconds


def render(results: list[dict]) -> str:
    header = (
        f"{'scenario':<32} {'replicas':>8} {'machine $':>10} {'$/1M tok':>9} {'revenue $':>10} {'margin $':>10} "
        f"{'vs today':>9} {'hit':>5}  per tier: TTFT p50/p99, ITL p50/p99 (ms)"
    )
    lines = [header]
    for r in results:
        latency = ", ".join(
            f"{tier} {_ms(v['ttft_p50_s'])}/{_ms(v['ttft_p99_s'])}, {_ms(v['itl_p50_s'])}/{_ms(v['itl_p99_s'])}"
            for tier, v in r["latency"].items()
        )
        lines.append(
            f"{r['scenario']:<32} {r['replicas']:>8} {r['machine_cost']:>10.4f} {r['machine_cost_per_1m_tokens']:>9.3f}"
            f" {r['revenue']:>10.4f} {r['margin']:>10.4f} {r['margin_change']:>+9.4f} {r['hit_rate']:>5.2f}  {latency}"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in results]
    figure, axis = plt.subplots(figsize=(8, 3.5))
    axis.barh(
        names, [r["margin"] for r in results], color=["#58a6ff" if r["margin"] >= 0 else "#f85149" for r in results]
    )
    axis.axvline(0, color="black", linewidth=0.8)
    axis.set_xlabel("margin over the replayed window ($): revenue less the machine's cost")
    axis.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def add_parser(cost_commands) -> None:
    parser = cost_commands.add_parser(
        "whatif",
        help="replay the ledger's traffic through the simulator under each lever (prefix cache, Batch API, "
        "compression, SLO steps, replicas): machine cost, revenue, margin and latency per tier against today",
    )
    parser.add_argument("--db", default=None, help="the ledger (default: $CARPOOL_DB or ~/.cache/carpool/carpool.db)")
    parser.add_argument("--since", type=parse_time, default=None, help="unix seconds or ISO 8601 (UTC), inclusive")
    parser.add_argument("--until", type=parse_time, default=None, help="unix seconds or ISO 8601 (UTC), exclusive")
    parser.add_argument("--model", default=None, help="the served model's rows to replay (default: the busiest)")
    parser.add_argument("--hourly-price", type=float, required=True, help="dollars an hour a replica costs")
    parser.add_argument("--prices", default=None, help="the price sheet revenue is billed by (default: shipped)")
    parser.add_argument("--replicas-today", type=int, default=1, help="replicas the traffic ran on (default: 1)")
    parser.add_argument("--replicas", type=_counts, default=[], help="replica counts to try, e.g. 1,2,4")
    parser.add_argument(
        "--tiers",
        type=_names,
        default=frozenset(),
        help="replay only these tiers' rows (default: all), e.g. the live ones, as `carpool bench ledger-replay` sends",
    )
    parser.add_argument("--batch-tenants", type=_names, default=frozenset(), help="tenants moved to the Batch API")
    parser.add_argument("--batch-tiers", type=_names, default=frozenset(), help="tiers moved to the Batch API")
    cheaper = {  # the share of rows each sends where: what `carpool cascade evaluate` reports at a threshold
        "--router": (
            "MODEL:SHARE",
            "a router sending SHARE of the rows to MODEL, a cheaper model on a replica of its own",
        ),
        "--cascade": (
            "MODEL:ESCALATED",
            "a cascade trying every row on MODEL first (a replica of its own), ESCALATED of them then on the recorded one",
        ),
    }
    for flag, (metavar, text) in cheaper.items():
        parser.add_argument(flag, type=_model_share, default=(None, 0.0), metavar=metavar, help=text)
    parser.add_argument(
        "--cheap-step",
        default=None,
        metavar="BASE,...",
        help="the --router/--cascade model's step model in seconds, as --step (default: fitted here)",
    )
    parser.add_argument(
        "--breakpoint-ttl",
        action="append",
        choices=sorted(BREAKPOINT_TTLS),
        default=[],
        help="a cache breakpoint on every prompt's shared prefix with this TTL (repeatable): pinned against eviction, "
        "written at the sheet's rate for it",
    )
    parser.add_argument(
        "--compress-rate", type=_rate, default=None, help="compress prompts to this share of their tokens, in (0, 1)"
    )
    parser.add_argument(
        "--compress-min-tokens", type=int, default=1024, help="only prompts at least this long (default: 1024)"
    )
    for kind in ("itl", "ttft"):
        parser.add_argument(
            f"--slo-{kind}-ms",
            action="append",
            default=None,
            metavar="TIER=MS",
            help=f"replay with the SLO controller sizing steps for this {kind.upper()} target (repeatable), as "
            f"`carpool serve --slo-{kind}-ms` runs it, against today's fixed steps",
        )
    parser.add_argument(
        "--step",
        default=None,
        metavar="BASE,PER_PREFILL_TOKEN,PER_DECODE_SEQ[,PER_CONTEXT_TOKEN[,PER_PREFILL_STEP[,PER_PREFILL_PAIR[,NOISE]]]]",
        help="a step model in seconds instead of fitting one to this machine (carpool bench simulate's)",
    )
    parser.add_argument(
        "--steps",
        default=None,
        metavar="FILE",
        help="fit the step model on the steps the recorded traffic took (`carpool serve --step-log FILE`, the "
        "served model's steps in the --since/--until window) instead of on a fresh engine here",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the fitted step model")
    parser.add_argument(
        "--fit-model",
        default=None,
        help="the model (catalog name or path) to fit the step model on (default: the rows' served model)",
    )
    parser.add_argument(
        "--draws",
        type=int,
        default=DRAWS,
        metavar="N",
        help=f"replays of each scenario, each drawing its steps' times anew; each latency figure is their median "
        f"(default: {DRAWS})",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="each replica's sequence slots")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="each replica's step token budget")
    parser.add_argument(
        "--step-tokens",
        type=_counts,
        default=[],
        help="step token budgets to try against today's --max-num-batched-tokens, e.g. 256,1024: smaller steps cut "
        "the time between tokens while a prompt is computed, at its time to first token",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=ReplicaSpec.num_blocks, help="each replica's KV pool")
    parser.add_argument("--out", default="bench-results/whatif.json", help="the JSON report (the plot beside it)")
    parser.set_defaults(func=main)


def fit_target(served: str) -> str:
    """The model a step model is fitted on for rows of the served model `served`: that name (a catalog name or a
    path), or the catalog's default model where `served` is the name `carpool serve` gives the embedded GGUF."""
    from carpool.models.catalog import DEFAULT_MODEL, default_model_path, model_name

    return DEFAULT_MODEL if served == model_name(default_model_path()) else served


def _fitted(model: str, args: argparse.Namespace) -> StepModel:
    from carpool.engine.config import EngineConfig

    return measure_step_model(EngineConfig(model=model, num_threads=args.threads))


def _model_share(text: str) -> tuple[str, float]:
    model, _, share = text.rpartition(":")
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if not model or not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected MODEL:SHARE with SHARE in [0, 1], got {text!r}")
    return model, value


def _counts(text: str) -> list[int]:
    counts = [int(value) for value in text.split(",")]
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"each must be at least 1, got {text!r}")
    return counts


def _rate(text: str) -> float:
    rate = float(text)
    if not 0 < rate < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1): the share of a prompt's tokens kept, got {text}")
    return rate


def _names(text: str) -> frozenset:
    return frozenset(name for name in text.split(",") if name)


def main(args: argparse.Namespace) -> int:
    if args.hourly_price <= 0:
        raise ValueError(f"--hourly-price must be positive, got {args.hourly_price}")
    if args.draws < 1:
        raise ValueError(f"--draws must be at least 1, got {args.draws}")
    for flag, tiers in (("--batch-tiers", args.batch_tiers), ("--tiers", args.tiers)):
        unknown = sorted(tiers - set(TIER_NAMES))
        if unknown:
            raise ValueError(f"{flag}: unknown tier {unknown[0]!r} (known: {', '.join(TIER_NAMES)})")
    rows, left_out = recorded_rows(args.db or default_db_path(), args.model, args.since, args.until)
    if args.tiers:
        rows = [row for row in rows if row.job.tier in args.tiers]
    if not rows:
        raise ValueError(
            f"--db: no row in that window has an arrival time ({left_out} written before the ledger kept it)"
        )
    if args.step and args.steps:
        raise ValueError("--step and --steps: give one of them")
    if args.steps:
        logged = read_steps(args.steps, rows[0].model, args.since, args.until)
        if len(logged) < 4:
            raise ValueError(f"--steps: {len(logged)} steps of {rows[0].model} in {args.steps} in that window; need 4")
        step = StepModel.fit(logged)
    else:
        step = StepModel.parse(args.step) if args.step else _fitted(args.fit_model or fit_target(rows[0].model), args)
    cheap = args.router[0] or args.cascade[0]
    cheap_step = None
    if cheap is not None:
        cheap_step = StepModel.parse(args.cheap_step) if args.cheap_step else _fitted(cheap, args)
    results, admission = whatif(rows, args, step, cheap_step)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # What the ledger billed these rows, beside the replay's "today": the two differ by cache hits and writes the
    # simulator's LRU finds or makes where the engine did not.
    ledger_revenue = sum(row.billed for row in rows)
    document = {
        "model": rows[0].model,
        "rows": len(rows),
        "left_out": left_out,
        "ledger_revenue": ledger_revenue,
        "step_model": vars(step),
        "admission_s": admission,
        "draws": args.draws,
    }
    out.write_text(json.dumps(document | {"scenarios": results}, indent=2) + "\n")
    _plot(results, out.with_suffix(".png"))
    print(
        f"{rows[0].model}: {len(rows)} requests replayed ({left_out} without an arrival time left out), "
        f"billed ${ledger_revenue:.4f} in the ledger; admission {admission * 1000:.1f} ms (fitted to their TTFT)"
    )
    print(render(results))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
