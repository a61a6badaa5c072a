"""`carpool bench cache-ttl`: what a prompt-cache TTL buys agents that come back every few minutes, under memory
pressure from other tenants, with no breakpoint, a 5-minute one and a 1-hour one side by side in one run.

The workload: --agents agents of one tenant share a system prompt (and tools) of --system-tokens tokens; each comes
back after a gap drawn from [--min-gap, --max-gap] minutes, with a new --turn-tokens task, until --minutes have
passed. Between turns other tenants send distinct prompts of --pressure-prompt-tokens tokens at
--pressure-tokens-per-minute, so the LRU cache churns: a prefix nobody pins survives a short gap and is evicted by a
long one. The pressure of a gap is capped at the pool's size: past that every unpinned block has been evicted
already, and computing more would change nothing but the run's length.

A real engine (the in-process LLMEngine, SmolLM2 by default) runs every prompt; only the TTLs' time is simulated:
an injected clock jumps to each turn's minute, so an hour takes seconds. The three modes run one after the other
on one engine (its kernels warmed once), each under its own tenant salt and with every earlier pin lapsed, so no
mode reads another's prefix. TTFT is each agent turn's wall time to its first token, one request at a time; the
billed input cost is the shipped price sheet's (carpool.economics.prices) for the turn's prompt: writes at 1.25x
(automatic and 5m) or 2x (1h), reads at 0.1x.
"""

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from carpool.economics.contract import UsageRecord, ttl_write_tokens
from carpool.economics.prices import load_price_sheet
from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.request import CacheBreakpoint
from carpool.engine.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0)
MODES = {"no breakpoint": None, "5m": 300.0, "1h": 3600.0}
BLOCK_SIZE = 16


class SimulatedClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def add_parser(modes) -> None:
    parser = modes.add_parser(
        "cache-ttl", help="prompt-cache TTLs: no breakpoint vs 5m vs 1h for returning agents under memory pressure"
    )
    parser.add_argument("--agents", type=int, default=2, help="agents sharing the system prompt")
    parser.add_argument("--system-tokens", type=int, default=3008, help="the shared system prompt and tools")
    parser.add_argument("--turn-tokens", type=int, default=128, help="each turn's own task after the system prompt")
    parser.add_argument("--minutes", type=float, default=45.0, help="simulated time the agents keep coming back")
    parser.add_argument("--min-gap", type=float, default=2.0, help="shortest gap between an agent's turns (min)")
    parser.add_argument("--max-gap", type=float, default=20.0, help="longest gap between an agent's turns (min)")
    parser.add_argument(
        "--pressure-tokens-per-minute",
        type=int,
        default=1024,
        help="other tenants' prompt tokens: 1024 evicts an unpinned system prompt in about 6 minutes on 400 blocks",
    )
    parser.add_argument(
        "--pressure-prompt-tokens", type=int, default=2048, help="one other tenant's prompt (one 2048-token step)"
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=400,
        help="the KV pool (16-token blocks): 400 holds the system prompt twice, so pressure decides what survives",
    )
    parser.add_argument(
        "--cache-min-tokens",
        type=int,
        default=None,
        help="the shortest prefix a breakpoint pins (default: the shipped price sheet's [cache] min_tokens)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="the modes to run, in this order (the run's load drifts: reverse it to see how much)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the gaps and every prompt's tokens")
    parser.add_argument("--out", default="bench-results/cache_ttl.json", help="where the JSON report goes")
    parser.set_defaults(func=main)


def schedule(args: argparse.Namespace) -> list[tuple[float, int]]:
    """(minute, agent) of every turn, in time order: each agent starts within the shortest gap and returns after
    gaps drawn uniformly from [min_gap, max_gap]."""
    rng = random.Random(args.seed)
    turns = []
    for agent in range(args.agents):
        minute = rng.uniform(0, args.min_gap)
        while minute < args.minutes:
            turns.append((minute, agent))
            minute += rng.uniform(args.min_gap, args.max_gap)
    return sorted(turns)


def tokens(seed: int, count: int) -> list[int]:
    """Distinct, reproducible token ids (the cache sees only ids; the text behind them does not matter)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(count)]


def run_turn(engine: LLMEngine, request_id: str, prompt: list[int], salt: str, breakpoints=()) -> tuple:
    """One request alone to its first token: (wall seconds to it, its output)."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, FIRST_TOKEN, cache_salt=salt, cache_breakpoints=breakpoints)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                return time.perf_counter() - start, output
    raise RuntimeError(f"{request_id} ended without an output")


def input_cost(prices, output, model: str) -> float:
    """The turn's billed input dollars (its one output token left out)."""
    writes_5m, writes_1h = ttl_write_tokens(output.cache_write_tokens_by_ttl)
    usage = UsageRecord(
        "bench", model, "default", output.num_prompt_tokens, output.num_cached_tokens,
        output.num_cache_write_tokens, 0, 0.0, 0.0, 0.0, "stop",
        cache_write_5m_tokens=writes_5m, cache_write_1h_tokens=writes_1h,
    )  # fmt: skip
    return prices.cost(usage)


def run_mode(engine, clock, args, mode: str, ttl: float | None, turns, prices, model: str) -> dict:
    clock.now += 100 * 3600  # every earlier mode's pins lapse before this one starts
    engine.block_manager.expire_pins()
    expired_before = sum(engine.block_manager.pin_stats.expired_blocks.values())
    system = tokens(args.seed, args.system_tokens)
    breakpoints = (CacheBreakpoint(args.system_tokens, ttl),) if ttl else ()
    pool_tokens = engine.block_manager.num_blocks * BLOCK_SIZE
    start, last_minute, pressure_left, others = clock.now, 0.0, 0.0, 0
    ttfts, costs, cached, computed = [], [], 0, 0
    for n, (minute, agent) in enumerate(turns):
        pressure_left = min(pressure_left + (minute - last_minute) * args.pressure_tokens_per_minute, pool_tokens)
        last_minute, clock.now = minute, start + minute * 60
        while pressure_left >= args.pressure_prompt_tokens:
            pressure_left -= args.pressure_prompt_tokens
            others += 1
            other = tokens(args.seed + 10**6 * others, args.pressure_prompt_tokens)  # the same in every mode
            run_turn(engine, f"{mode}-others-{others}", other, salt=f"{mode}-others")
        prompt = system + tokens(args.seed + 1 + n, args.turn_tokens)
        seconds, output = run_turn(engine, f"{mode}-agent-{n}", prompt, salt=f"{mode}-agents", breakpoints=breakpoints)
        ttfts.append(seconds)
        costs.append(input_cost(prices, output, model))
        cached += output.num_cached_tokens
        computed += output.num_prompt_tokens - output.num_cached_tokens
    return {
        "turns": len(turns),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "input_cost_per_turn_usd": float(np.mean(costs)),
        "prompt_tokens_read_from_cache": cached,
        "prompt_tokens_computed": computed,
        "pins_expired_blocks": sum(engine.block_manager.pin_stats.expired_blocks.values()) - expired_before,
    }


def main(args: argparse.Namespace) -> int:
    clock = SimulatedClock()
    prices = load_price_sheet()
    request_tokens = max(args.system_tokens + args.turn_tokens, args.pressure_prompt_tokens)
    config = EngineConfig(
        num_kv_blocks=args.num_kv_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=-(-request_tokens // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE,
        max_num_batched_tokens=2048,
        cache_pin_fraction=0.5,
        cache_min_tokens=prices.cache_min_tokens if args.cache_min_tokens is None else args.cache_min_tokens,
    )
    engine = LLMEngine(config, clock=clock)
    model = "smollm2-135m"
    turns = schedule(args)
    # Unmeasured: the shapes the modes run (a miss, a hit, another tenant's prompt) once, to warm the kernels.
    system = tokens(args.seed - 1, args.system_tokens)
    for i, prompt in enumerate((system + tokens(-1, args.turn_tokens), system + tokens(-2, args.turn_tokens))):
        run_turn(engine, f"warm-up-{i}", prompt, salt="warm-up")
    run_turn(engine, "warm-up-others", tokens(-3, args.pressure_prompt_tokens), salt="warm-up")
    report = {"command": "carpool bench cache-ttl", "args": vars(args) | {"func": None}, "modes": {}}
    for mode in args.modes:
        ttl = MODES[mode]
        report["modes"][mode] = row = run_mode(engine, clock, args, mode, ttl, turns, prices, model)
        print(
            f"{mode:14} {row['turns']} turns | TTFT p50 {row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s | "
            f"input {row['input_cost_per_turn_usd'] * 1e6:.2f} micro-$ per turn | "
            f"read {row['prompt_tokens_read_from_cache']} computed {row['prompt_tokens_computed']} tokens",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0
