"""`carpool bench ledger-replay`: the ledger's recorded traffic sent for real to a running server, to hold
`carpool cost whatif`'s predictions against (issue 50: a lever's predicted latency and hit rate against the same
traffic served under that lever).

The ledger keeps no text, only each prompt's length and the chain of its blocks' hashes, so the prompts are
rebuilt as token ids: each hash stands for the same 16 ids wherever it appears (ids drawn from a generator seeded
by the hash), and what follows the last full block is ids of this request's own. Prompts that shared a prefix
share it again, block for block, and no others do. Each row is sent at its recorded arrival (the gaps divided by
`--speed`) to /v1/completions, streamed, in its recorded tier, for exactly its recorded output tokens
(`ignore_eos`). Batch API rows are not live requests and are left out (counted).

The report has the whatif's shape: time to first token and between tokens p50/p99 per tier, the prefix-cache
hit rate the server reported (usage's cached tokens), the span. Those are the client's; with `--server-db` (the
server's own ledger) it also has the server's time to first token per tier (each row's queue plus prefill
seconds, from its arrival at the server), which is what the whatif predicts: the client's adds its HTTP round
trip and the encoding of a prompt of token ids (~10 ms on 2 cores, 2026-12-06).
"""

import argparse
import asyncio
import itertools
import json
import random
import time
from pathlib import Path

import httpx

from carpool.bench.serve import latency_summary, percentile
from carpool.bench.whatif import Recorded, recorded_rows
from carpool.economics.db import open_database
from carpool.economics.reports import parse_time
from carpool.engine.tiers import BATCH_TIER, TIER_NAMES

BLOCK_TOKENS = 16  # the ledger's chains are of the engine's 16-token blocks
TOKEN_RANGE = (1000, 30000)  # ids every catalog model's vocabulary has, clear of its special tokens


def prompt_ids(row: Recorded, index: int) -> list[int]:
    """Token ids with the recorded prompt's length and block structure."""
    ids = []
    for block in row.job.chain:
        ids += _draw(random.Random(block), BLOCK_TOKENS)
    return ids + _draw(random.Random(f"tail-{index}"), row.job.prompt_tokens - len(ids))


def _draw(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


async def send(client: httpx.AsyncClient, model: str, row: Recorded, index: int, headers: dict) -> dict:
    body = {
        "model": model,
        "prompt": prompt_ids(row, index),
        "max_tokens": max(row.job.output_tokens, 1),
        "ignore_eos": True,
        "temperature": 0,
        "service_tier": row.job.tier,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    arrivals, usage, status = [], None, None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices") and event["choices"][0].get("text") is not None:
                arrivals.append(time.monotonic())
    return {
        "tier": row.job.tier,
        "status": status,
        "ttft": arrivals[0] - sent if arrivals else None,
        "itl": [later - earlier for earlier, later in itertools.pairwise(arrivals)],
        "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


async def replay_rows(url: str, rows: list[Recorded], speed: float, api_key: str | None) -> tuple[list[dict], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        model = (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        first, began = rows[0].job.arrival, time.monotonic()

        async def one(index: int, row: Recorded) -> dict:
            await asyncio.sleep(max(0.0, (row.job.arrival - first) / speed - (time.monotonic() - began)))
            return await send(client, model, row, index, headers)

        results = await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    return list(results), time.monotonic() - began


def report(results: list[dict], span: float) -> dict:
    prompt = sum(r["prompt_tokens"] for r in results)
    return {
        "requests": len(results),
        "errors": sum(1 for r in results if r["status"] != 200),
        "seconds": span,
        "hit_rate": sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0,
        "latency": {
            tier: latency_summary(ttft, itl) for tier in TIER_NAMES for ttft, itl in [_latencies(results, tier)] if ttft
        },
    }


def _latencies(results: list[dict], tier: str) -> tuple[list[float], list[float]]:
    mine = [r for r in results if r["tier"] == tier and r["ttft"] is not None]
    return [r["ttft"] for r in mine], [gap for r in mine for gap in r["itl"]]


def server_ttft(db: str, since: float) -> dict:
    """Per tier, p50/p99 of queue + prefill seconds of the rows of `db` that arrived from `since` (unix seconds)."""
    conn = open_database(db)
    try:
        rows = conn.execute(
            "SELECT tier, queue_seconds + prefill_seconds FROM ledger WHERE arrived >= ? AND purpose = 'request'",
            (since,),
        ).fetchall()
    finally:
        conn.close()
    by_tier: dict[str, list[float]] = {}
    for tier, seconds in rows:
        by_tier.setdefault(tier, []).append(seconds)
    return {
        tier: {"ttft_p50_s": percentile(values, 50), "ttft_p99_s": percentile(values, 99)}
        for tier, values in by_tier.items()
    }


# How close a prediction must come to count as held (issue 50): cost and p50 latencies within 15%, p99s within 30%.
BOUNDS = {
    "seconds": 0.15,
    "hit_rate": 0.15,
    "ttft_p50_s": 0.15,
    "itl_p50_s": 0.15,
    "ttft_p99_s": 0.30,
    "itl_p99_s": 0.30,
}


def compare(predicted: dict, real: dict) -> dict:
    """A whatif scenario against this replay of it: per figure, (predicted, real, predicted / real - 1, held). The
    span stands for the machine's cost (replicas x hourly price x span); TTFT is the server's where the replay read
    its ledger (what the whatif predicts), ITL the client's."""
    latency = real.get("server_latency") or {}
    rows = {
        "seconds": (predicted["seconds"], real["seconds"]),
        "hit_rate": (predicted["hit_rate"], real["hit_rate"]),
    }
    for tier, figures in predicted["latency"].items():
        for key, value in figures.items():
            measured = (latency.get(tier) or {}).get(key) if key.startswith("ttft") and latency else None
            measured = measured if measured is not None else (real["latency"].get(tier) or {}).get(key)
            if value is not None and measured:
                rows[f"{tier} {key}"] = (value, measured)
    result = {}
    for name, (value, measured) in rows.items():
        error = value / measured - 1 if measured else (0.0 if value == measured else None)
        bound = BOUNDS[name.split()[-1]]
        result[name] = {
            "predicted": value,
            "real": measured,
            "error": error,
            "held": error is not None and abs(error) <= bound,
        }
    return result


def add_parser(modes) -> None:
    parser = modes.add_parser(
        "ledger-replay",
        help="send the ledger's recorded traffic (prompts rebuilt from its block-hash chains) to a running server, "
        "to check carpool cost whatif's predictions",
    )
    parser.add_argument("--url", default=None, help="the server to replay against")
    parser.add_argument("--db", default=None, help="the ledger whose rows are replayed")
    parser.add_argument("--since", type=parse_time, default=None, help="unix seconds or ISO 8601 (UTC), inclusive")
    parser.add_argument("--until", type=parse_time, default=None, help="unix seconds or ISO 8601 (UTC), exclusive")
    parser.add_argument("--model", default=None, help="the recorded model's rows (default: the busiest)")
    parser.add_argument("--speed", type=float, default=1.0, help="divide the recorded gaps by this (default: 1)")
    parser.add_argument("--api-key", default=None, help="sent as the bearer token")
    parser.add_argument(
        "--server-db", default=None, help="the server's own ledger: report its time to first token per tier too"
    )
    parser.add_argument(
        "--compare",
        default=None,
        metavar="WHATIF_JSON:SCENARIO",
        help="a `carpool cost whatif` report and the scenario this server runs: each figure predicted against real",
    )
    parser.add_argument(
        "--report",
        default=None,
        metavar="FILE",
        help="with --compare: hold a saved report of an earlier replay against the prediction, sending nothing",
    )
    parser.add_argument("--out", default="bench-results/ledger-replay.json", help="the JSON report")
    parser.set_defaults(func=main)


def _scenario(text: str) -> dict:
    path, _, name = text.rpartition(":")
    scenarios = {row["scenario"]: row for row in json.loads(Path(path).read_text())["scenarios"]}
    if name not in scenarios:
        raise ValueError(f"--compare: {path} has no scenario {name!r} (it has: {', '.join(scenarios)})")
    return scenarios[name]


def main(args: argparse.Namespace) -> int:
    if args.speed <= 0:
        raise ValueError(f"--speed must be positive, got {args.speed}")
    expected = _scenario(args.compare) if args.compare else None  # a wrong name fails before the replay
    if args.report:
        if expected is None:
            raise ValueError("--report: give --compare WHATIF_JSON:SCENARIO to hold the saved report against")
        _print_comparison(compare(expected, json.loads(Path(args.report).read_text())))
        return 0
    if not (args.url and args.db):
        raise ValueError("--url and --db: the server to replay against and the ledger to replay (or --report)")
    rows, left_out = recorded_rows(args.db, args.model, args.since, args.until)
    live = [row for row in rows if row.job.tier != BATCH_TIER]
    if not live:
        raise ValueError("--db: no live request with an arrival time in that window")
    began = time.time()
    results, span = asyncio.run(replay_rows(args.url, live, args.speed, args.api_key))
    document = report(results, span) | {"left_out": left_out, "batch_rows_left_out": len(rows) - len(live)}
    if args.server_db:
        document["server_latency"] = server_ttft(args.server_db, began)
    if expected is not None:
        document["comparison"] = compare(expected, document)
        _print_comparison(document["comparison"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({key: document[key] for key in ("requests", "errors", "seconds", "hit_rate")}))
    print(f"wrote {out}")
    return 0


def _print_comparison(comparison: dict) -> None:
    for name, row in comparison.items():
        error = "-" if row["error"] is None else f"{row['error']:+.0%}"
        print(
            f"{name:<24} predicted {row['predicted']:.4g}  real {row['real']:.4g}  {error:>6}  {'held' * row['held']}"
        )
