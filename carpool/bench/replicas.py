"""`carpool bench replicas`: multi-tenant document QA and multi-turn chat replayed across `carpool serve
--replicas N`, once per routing policy (prefix-cache hit rate, TTFT, ITL), the same load on one replica with all
the threads (throughput: N replicas x 1 thread vs 1 replica x N threads), and the simulator's prediction of each
(carpool.bench.simulate, step times fitted to this machine's engine steps) beside the measurement.

Workload (real text from carpool/bench/data): document QA = meeting transcripts from long_docs.jsonl, each asked
its questions, one request a question; chat = conversations from chat_prompts.jsonl replayed turn by turn with
the recorded replies as history, behind their tenant's system prompt. Every meeting and conversation belongs to
one of --tenants tenants (the request's `user`, so the server salts their caches apart). Sessions (a question,
a conversation) start as a Poisson process at --rate a second, in an order that interleaves documents, and a
conversation's next turn is sent when its previous one ends. Prompts go as token ids to /v1/completions.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from carpool.bench.local_server import free_port, wait_healthy
from carpool.bench.serve import latency_summary
from carpool.bench.sessions import Session, Turn, workload
from carpool.bench.simulate import ReplicaSpec, measure_step_model, poisson_arrivals, simulate
from carpool.engine.config import EngineConfig
from carpool.models import Tokenizer
from carpool.models.loader import resolve_model_dir


def add_parser(modes) -> None:
    parser = modes.add_parser(
        "replicas",
        help="replicas on Ray Serve: prefix vs round-robin routing, N x 1 "
        "thread vs 1 x N threads, and the simulator against both",
    )
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (each one thread)")
    parser.add_argument(
        "--routing",
        nargs="+",
        default=["prefix", "round-robin"],
        help="routing policies to replay, in turn: prefix, least-loaded, round-robin",
    )
    parser.add_argument("--meetings", type=int, default=6, help="transcripts in the document QA workload")
    parser.add_argument("--max-doc-words", type=int, default=900, help="skip longer transcripts")
    parser.add_argument("--chats", type=int, default=6, help="multi-turn conversations in the chat workload")
    parser.add_argument("--tenants", type=int, default=3, help="API keys the sessions are spread over")
    parser.add_argument("--rate", type=float, default=1.0, help="sessions started a second")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens a request")
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV pool of each of the N replicas (the 1-replica run gets N times as many): below the "
        "workload's working set, as a busy deployment's cache is (default: the server's)",
    )
    parser.add_argument("--skip-throughput", action="store_true", help="no 1 replica x N threads run")
    parser.add_argument(
        "--hourly-price",
        type=float,
        default=0.10,
        help="dollars an hour one replica's share of the machine costs, for the simulator's cost",
    )
    parser.add_argument("--out", default="bench-results/replicas.json", help="where the JSON results go")
    parser.set_defaults(func=main)


@dataclass
class Measured:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        return {
            "requests": len(self.ttft),
            "errors": len(self.errors),
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            **latency_summary(self.ttft, self.itl),
            "output_tokens_per_s": self.output_tokens / self.seconds if self.seconds else 0.0,
        }


async def replay(url: str, sessions: list[Session], arrivals: list[float]) -> Measured:
    measured = Measured()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()

        async def run(session: Session, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            for turn in session.turns:
                await _one(client, turn, session.salt.removeprefix("user:"), measured)

        await asyncio.gather(*(run(s, a) for s, a in zip(sessions, arrivals)))
        measured.seconds = time.perf_counter() - start
    return measured


async def _one(client: httpx.AsyncClient, turn: Turn, user: str, measured: Measured) -> None:
    body = {
        "prompt": turn.prompt_token_ids,
        "max_tokens": turn.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": user,
    }
    sent, last = time.perf_counter(), None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            measured.errors.append(f"HTTP {response.status_code}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk, now = json.loads(line[5:]), time.perf_counter()
            if chunk.get("error"):
                measured.errors.append(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
                measured.prompt_tokens += usage["prompt_tokens"]
                measured.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                measured.output_tokens += usage["completion_tokens"]
            if chunk.get("choices"):
                if last is None:
                    measured.ttft.append(now - sent)
                else:
                    measured.itl.append(now - last)
                last = now


class Server:
    """`carpool serve` in a subprocess with a ledger and batch dir of its own."""

    def __init__(self, *flags: str):
        self.home = tempfile.mkdtemp(prefix="carpool-bench-replicas-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "CARPOOL_DB": f"{self.home}/carpool.db", "CARPOOL_BATCH_DIR": f"{self.home}/batches"}
        self.log = open(f"{self.home}/serve.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "carpool.cli", "serve", "--port", str(self.port), "--log-level", "warning", *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def __enter__(self) -> Self:
        if not wait_healthy(self.url, self.process, 600):
            self.__exit__()
            raise RuntimeError(f"carpool serve did not start; see {self.home}/serve.log")
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def main(args: argparse.Namespace) -> int:
    tokenizer = Tokenizer.from_dir(resolve_model_dir(args.model))
    sessions = workload(tokenizer, args.meetings, args.max_doc_words, args.chats, args.tenants, args.max_tokens)
    arrivals = poisson_arrivals(len(sessions), args.rate)
    threads = os.cpu_count() or 1
    per_replica = max(1, threads // args.replicas)
    model = ["--model", args.model] if args.model else []

    def pool(replicas: int) -> list[str]:
        return (
            []
            if args.num_kv_blocks is None
            else ["--num-kv-blocks", str(args.num_kv_blocks * args.replicas // replicas)]
        )

    runs = [
        (
            f"{args.replicas}x{per_replica} {routing}",
            args.replicas,
            per_replica,
            routing,
            [
                "--replicas",
                str(args.replicas),
                "--num-threads",
                str(per_replica),
                "--routing",
                routing,
                *pool(args.replicas),
            ],
        )
        for routing in args.routing
    ]
    if not args.skip_throughput:
        runs.append((f"1x{threads}", 1, threads, "prefix", ["--num-threads", str(threads), *pool(1)]))
    report = {
        "cpu": _cpu_name(),
        "cpus": threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["carpool", "bench", "replicas", *sys.argv[3:]]),
        "sessions": len(sessions),
        "requests": sum(len(s.turns) for s in sessions),
        "rate": args.rate,
        "runs": {},
    }
    step_models = {}
    for label, replicas, replica_threads, routing, flags in runs:
        with Server(*model, *flags) as server:
            measured = asyncio.run(replay(server.url, sessions, arrivals))
        if replica_threads not in step_models:  # after the server: the fit's engine runs alone
            step_models[replica_threads] = measure_step_model(
                EngineConfig(model=args.model, num_threads=replica_threads)
            )
        step = step_models[replica_threads]
        blocks = int(pool(replicas)[1]) if args.num_kv_blocks else ReplicaSpec().num_blocks
        predicted = simulate(sessions, arrivals, replicas, routing, step, ReplicaSpec(num_blocks=blocks))
        report["runs"][label] = {
            "measured": measured.summary(),
            "simulated": predicted.summary(args.hourly_price),
            "step_model": vars(step),
            "errors": sorted(set(measured.errors))[:5],
        }
        print(
            f"{label}: measured {_line(measured.summary())}\n{' ' * len(label)}  simulated "
            f"{_line(predicted.summary(args.hourly_price))}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _line(summary: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.0f} ms"

    return (
        f"hit rate {summary['hit_rate']:.2f}, TTFT p50 {ms(summary['ttft_p50_s'])} p99 "
        f"{ms(summary['ttft_p99_s'])}, ITL p50 {ms(summary['itl_p50_s'])}, "
        f"{summary['output_tokens_per_s']:.1f} output tok/s"
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
