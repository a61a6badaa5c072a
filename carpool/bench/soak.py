"""`carpool bench soak --minutes M`: an hour under fire. Mixed traffic against a real `carpool serve` (two models,
three live tiers, streams the client leaves early, structured outputs, a cascade, Batch API jobs) while faults land
on a schedule (kill -9 and a restart; a window in which the ledger's disk is full), then the invariants that the
money and the memory must keep:

- every response a client received whole has exactly one billed ledger row (found by the `x-request-id` the client
  sent or the response's own id); no request id is billed twice; a request the client never received (refused,
  cut by a fault) has no billed row, unless the fault cut it after its row was committed (counted apart: the row
  is written before the last byte, so kill -9 between the two bills what the client did not see);
- no key spends past its budget;
- every KV block is free once the server is idle;
- the server's resident memory after warm-up, less the KV pools' pages, stays flat within 5%, and all of it stays
  within the start's plus the pools' bytes (sampled every few seconds with `carpool:kv_cache_resident_bytes`,
  plotted): a CPU pool's pages are backed on first touch and the prefix cache's LRU free list hands out every
  block in turn, so RSS grows by the pools over the first minutes of slow traffic and then stops.

The ledger and the batch dir live on a small tmpfs of their own (a real full disk for the window; where mounting is
not allowed, the window is skipped and the report says so). With `--db postgres` the ledger is a PostgreSQL server
the soak starts (carpool.bench.postgres_server) and takes down for a window mid-run, as a crash would.
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from carpool.bench.local_server import free_port, wait_healthy
from carpool.bench.postgres_server import PostgresServer, postgres_bin_dir
from carpool.economics.db import open_database

ABORT_SHARE = 0.3  # streams the client leaves after its first token, as the issue's soak did
RSS_FLAT = 0.05  # resident memory after warm-up, less the KV pools' pages, may move this much, no more
POSTGRES_DOWN_SECONDS = 10
KINDS = ("chat", "stream", "completion", "structured", "cascade")
TIERS = ("priority", "default", "flex")
CASCADES = """[[cascade]]
name = "soak-cascade"
[[cascade.step]]
model = "small"
scorer = "mean"
threshold = -1.5
[[cascade.step]]
model = "other"
"""
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def add_parser(modes) -> None:
    parser = modes.add_parser("soak", help="mixed traffic with faults on a schedule, then the ledger's invariants")
    parser.add_argument("--minutes", type=float, default=60.0, help="how long traffic runs (default: 60)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent clients (default: 16)")
    parser.add_argument("--model", default="smollm2-135m", help="served twice, as `small` and `other`")
    parser.add_argument("--max-tokens", type=int, default=24, help="output tokens a request at most")
    parser.add_argument(
        "--db",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="the ledger: a SQLite file (default), or a PostgreSQL server the soak starts and restarts mid-run",
    )
    parser.add_argument("--no-faults", action="store_true", help="traffic only: no kill -9, no full disk")
    parser.add_argument("--budget", type=float, default=0.0002, help="each budgeted tenant's daily budget, dollars")
    parser.add_argument("--no-warmup", action="store_true", help="start (and restart) the server without warm-up")
    parser.add_argument("--seed", type=int, default=0, help="the traffic's random choices (default: 0)")
    parser.add_argument("--out", default="bench-results/soak.json", help="report (JSON; the RSS plot beside it)")
    parser.set_defaults(func=main)


@dataclass
class Sent:
    """One request as the client saw it."""

    ids: set[str]  # the x-request-id it sent, and the response's id once one arrived
    kind: str
    key: str
    outcome: str = "pending"  # whole | left (the client left mid-stream) | refused (4xx) | failed (5xx, cut)
    why: str = ""  # a refusal's or failure's status or error, for the report
    during_fault: bool = False  # it ended while a fault was on (the server killed and restarting, the disk full)


@dataclass
class Home:
    root: Path
    disk: Path  # the ledger's (on SQLite) and the batch dir's folder: a tmpfs of its own where mounting is allowed
    mounted: bool
    db: str  # the ledger: a SQLite file on the disk, or the soak's PostgreSQL server's URL
    postgres: PostgresServer | None = None
    env: dict = field(default_factory=dict)


def make_home(db_kind: str) -> Home:
    root = Path(tempfile.mkdtemp(prefix="carpool-soak-"))
    disk = root / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)], capture_output=True)
    postgres, db = None, str(disk / "carpool.db")
    if db_kind == "postgres":
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise SystemExit("--db postgres: PostgreSQL is not installed (`make postgres` installs it)")
        postgres = PostgresServer(bin_dir).start()
        db = postgres.create_database("carpool_soak")
    home = Home(root, disk, mounted.returncode == 0, db, postgres)
    home.env = {**os.environ, "CARPOOL_DB": db, "CARPOOL_BATCH_DIR": str(disk / "batches")}
    return home


def create_keys(home: Home, tenants: int, budget: float) -> list[str]:
    """Keys of `tenants` tenants with a daily budget each, and one without (whose requests always pass)."""
    secrets = []
    for tenant in range(tenants + 1):
        budget_args = ["--budget", str(budget), "--budget-period", "day"] if tenant < tenants else []
        created = subprocess.run(
            [sys.executable, "-m", "carpool.cli", "keys", "create", "--tenant", f"soak-{tenant}", *budget_args],
            capture_output=True,
            text=True,
            env=home.env,
            check=True,
        )
        secrets.append(created.stdout.strip().splitlines()[0])
    return secrets


class Server:
    """`carpool serve` over the home's ledger: started, killed and restarted by the schedule."""

    def __init__(self, home: Home, model: str, warmup: bool):
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cascades = home.root / "cascades.toml"
        cascades.write_text(CASCADES)
        self.flags = [
            *("--model", model, "--served-model-name", "small", "--model", model, "--served-model-name", "other"),
            *("--cascades", str(cascades), "--max-num-seqs", "16", "--log-level", "warning"),
            *(() if warmup else ("--no-warmup",)),
        ]
        self.started_at = 0.0
        self.process: subprocess.Popen | None = None
        self.log = open(home.root / "serve.log", "a")

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "carpool.cli", "serve", "--port", str(self.port), *self.flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.home.env,
        )
        if not wait_healthy(self.url, self.process, 600):
            raise RuntimeError(f"carpool serve did not start; see {self.home.root / 'serve.log'}")
        self.started_at = time.monotonic()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def rss_mb(self) -> float | None:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024


def request_body(kind: str, tier: str, max_tokens: int, rng: random.Random) -> tuple[str, dict]:
    topic = rng.choice(("tides", "bread", "comets", "ledgers", "bridges", "owls"))
    messages = [{"role": "user", "content": f"Tell me one fact about {topic}."}]
    body = {"model": rng.choice(("small", "other")), "max_tokens": max_tokens, "service_tier": tier}
    if kind == "completion":
        return "/v1/completions", body | {"prompt": f"A fact about {topic}:"}
    if kind == "structured":
        schema = {"name": "fact", "schema": SCHEMA, "strict": True}
        return "/v1/chat/completions", body | {
            "messages": messages,
            "response_format": {"type": "json_schema", "json_schema": schema},
        }
    if kind == "cascade":
        return "/v1/chat/completions", body | {"model": "soak-cascade", "messages": messages}
    return "/v1/chat/completions", body | {"messages": messages, "stream": kind == "stream"}


class FaultWindow:
    """Whether a fault is on now: set by the schedule's thread, read by the clients."""

    on = False


async def one_request(client: httpx.AsyncClient, sent: Sent, path: str, body: dict, leave: bool) -> None:
    request_id = next(iter(sent.ids))
    headers = {"Authorization": f"Bearer {sent.key}", "X-Request-Id": request_id}
    try:
        if not body.get("stream"):
            response = await client.post(path, json=body, headers=headers)
            if response.status_code == 200:
                sent.ids.add(response.json()["id"])
            sent.outcome = "whole" if response.status_code == 200 else _refusal(sent, response.status_code)
            return
        async with client.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                sent.outcome = _refusal(sent, response.status_code)
                return
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:  # the server ended the stream with an error event (a fault, say)
                        sent.outcome, sent.why = "failed", f"stream error {event['error'].get('type')}"
                        return
                    sent.ids.add(event["id"])
                    if leave:
                        sent.outcome = "left"
                        return  # leaving the block closes the connection: the server aborts the request
                if line == "data: [DONE]":
                    sent.outcome = "whole"
            if sent.outcome != "whole":
                sent.outcome = "failed"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        sent.outcome, sent.why = "failed", type(error).__name__


def _refusal(sent: Sent, status: int) -> str:
    sent.why = str(status)
    return "refused" if status < 500 else "failed"


async def traffic(url: str, keys: list[str], args, until: float, log: list[Sent]) -> None:
    rng = random.Random(args.seed)
    # A long timeout: on a loaded machine a request waits its turn among every stream's, and a timeout would count
    # as a failure the server did not have.
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

        async def worker(index: int) -> None:
            local = random.Random(rng.random())
            while time.monotonic() < until:
                kind, tier = local.choice(KINDS), local.choice(TIERS)
                sent = Sent({f"soak-{uuid.uuid4().hex}"}, kind, local.choice(keys))
                log.append(sent)
                path, body = request_body(kind, tier, args.max_tokens, local)
                await one_request(client, sent, path, body, leave=kind == "stream" and local.random() < ABORT_SHARE)
                sent.during_fault = FaultWindow.on
                if sent.outcome == "failed":
                    await asyncio.sleep(1.0)  # the server is down (a fault): retry after a pause, as clients do

        await asyncio.gather(*(worker(i) for i in range(args.streams)))


def submit_batch(url: str, key: str, lines: int, max_tokens: int) -> str | None:
    requests = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "small",
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Count to {i}."}],
            },
        }
        for i in range(lines)
    ]
    data = "\n".join(json.dumps(line) for line in requests).encode()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
        try:
            file = client.post("/v1/files", files={"file": ("soak.jsonl", data)}, data={"purpose": "batch"})
            batch = client.post(
                "/v1/batches",
                json={
                    "input_file_id": file.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            return batch.json()["id"] if batch.status_code == 200 else None
        except (httpx.HTTPError, KeyError):
            return None


def fill_disk(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(b"\0" * (1 << 20))
                out.flush()
        except OSError:
            pass  # full
    return filler


def batch_results(url: str, key: str, batch_ids: list[str], deadline: float) -> dict:
    """{batch id: its status and each custom_id's count in its output} once every batch has ended (or the deadline)."""
    results = {}
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
        for batch_id in batch_ids:
            while True:
                batch = client.get(f"/v1/batches/{batch_id}").json()
                if batch["status"] in ("completed", "failed", "cancelled", "expired") or time.monotonic() > deadline:
                    break
                time.sleep(2)
            counts: dict[str, int] = {}
            if batch.get("output_file_id"):
                for line in client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines():
                    custom_id = json.loads(line)["custom_id"]
                    counts[custom_id] = counts.get(custom_id, 0) + 1
            results[batch_id] = {"status": batch["status"], "answered": counts}
    return results


def ledger_checks(db: str, log: list[Sent]) -> dict:
    """The money invariants, read from the ledger itself."""
    connection = open_database(db)
    try:
        rows = connection.execute(
            "SELECT request_id, parent_request_id, key_id, cost, finish_reason, tier FROM ledger"
        ).fetchall()
        spent = {
            key: total for key, total in connection.execute("SELECT key_id, SUM(cost) FROM ledger GROUP BY key_id")
        }
        budgets = {
            key: limit for key, limit in connection.execute("SELECT key_id, budget FROM keys WHERE budget IS NOT NULL")
        }
    finally:
        connection.close()
    billed = [row for row in rows if row[3] > 0]
    by_id: dict[str, int] = {}
    for request_id, *_ in billed:
        by_id[request_id] = by_id.get(request_id, 0) + 1
    doubled = sorted(request_id for request_id, count in by_id.items() if count > 1)
    linked = {}
    for request_id, parent, *_ in billed:
        for name in (request_id, parent):
            if name:
                linked[name] = linked.get(name, 0) + 1
    whole = [sent for sent in log if sent.outcome == "whole"]
    unbilled_whole = [sorted(sent.ids) for sent in whole if not any(linked.get(name) for name in sent.ids)]
    not_received = [sent for sent in log if sent.outcome in ("refused", "failed", "pending")]
    billed_unseen = [sent for sent in not_received if any(linked.get(name) for name in sent.ids)]
    over_budget = {key: (spent.get(key, 0.0), limit) for key, limit in budgets.items() if spent.get(key, 0.0) > limit}
    return {
        "rows": len(rows),
        "billed_rows": len(billed),
        "batch_rows": sum(1 for row in billed if row[5] == "batch"),
        "doubled_ids": doubled,
        "whole_without_row": unbilled_whole,
        "billed_without_delivery": [
            {
                "ids": sorted(sent.ids),
                "kind": sent.kind,
                "outcome": sent.outcome,
                "why": sent.why,
                "in_fault": sent.during_fault,
            }
            for sent in billed_unseen
        ],
        "over_budget": over_budget,
        # A fault may cut a request after its row was committed (the row comes before the last byte); nothing else may.
        "ok": not doubled and not unbilled_whole and not over_budget and all(s.during_fault for s in billed_unseen),
    }


def metric_values(url: str, name: str) -> dict[str, float]:
    """{labels: value} of one of the server's gauges."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            labels, value = line.rsplit(" ", 1)
            values[labels] = float(value)
    return values


def kv_pool_megabytes(url: str) -> tuple[float, float] | None:
    """(the KV pools' MB, the MB of them backed by memory now), every model's together; None while the server is
    down."""
    try:
        pools = metric_values(url, "carpool:kv_cache_pool_bytes")
        resident = metric_values(url, "carpool:kv_cache_resident_bytes")
    except httpx.HTTPError:
        return None
    return sum(pools.values()) / 2**20, sum(resident.values()) / 2**20


@dataclass
class MemorySample:
    at_s: float
    rss_mb: float
    kv_resident_mb: float
    kv_pool_mb: float
    pid: int


def memory_checks(samples: list[MemorySample]) -> dict:
    """The last server process's memory (a restart starts afresh): RSS less the KV pools' resident pages, past the
    first third of its life (warm-up and first allocations), flat within RSS_FLAT; and RSS never above its first
    sample's non-KV memory plus the whole pools (with the same allowance)."""
    last = [sample for sample in samples if sample.pid == samples[-1].pid] if samples else []
    if len(last) < 2:
        return {"growth_outside_kv": None, "flat": False, "peak_over_start_plus_pools": None, "bounded": False}
    warm = [sample for sample in last if sample.at_s >= last[0].at_s + (last[-1].at_s - last[0].at_s) / 3]
    outside = [sample.rss_mb - sample.kv_resident_mb for sample in warm]
    growth = (outside[-1] - outside[0]) / outside[0]
    start_plus_pools = last[0].rss_mb - last[0].kv_resident_mb + last[0].kv_pool_mb
    peak = max(sample.rss_mb for sample in last)
    return {
        "growth_outside_kv": growth,
        "flat": abs(growth) <= RSS_FLAT,
        "peak_over_start_plus_pools": peak / start_plus_pools - 1,
        "bounded": peak <= start_plus_pools * (1 + RSS_FLAT),
    }


def main(args: argparse.Namespace) -> int:
    home = make_home(args.db)
    keys = create_keys(home, tenants=3, budget=args.budget)
    server = Server(home, args.model, warmup=not args.no_warmup)
    log: list[Sent] = []
    faults: list[dict] = []
    memory: list[MemorySample] = []
    server.start()
    start = time.monotonic()
    duration = args.minutes * 60
    until = start + duration
    batch_ids = [b for b in (submit_batch(server.url, keys[-1], 12, args.max_tokens),) if b]

    async def run() -> None:
        load = asyncio.create_task(traffic(server.url, keys, args, until, log))
        schedule = [(0.35, "kill -9"), *([(0.5, "postgres down")] if home.postgres else []), (0.65, "disk full")]
        schedule = [] if args.no_faults else schedule
        sampled = 0.0
        while time.monotonic() < until:
            now = time.monotonic() - start
            if schedule and now >= schedule[0][0] * duration:
                _, fault = schedule.pop(0)
                faults.append({"at_s": round(now, 1), "fault": fault, **await asyncio.to_thread(inject, fault)})
            if now - sampled >= 5:
                sampled = now
                megabytes, pools = server.rss_mb(), await asyncio.to_thread(kv_pool_megabytes, server.url)
                if megabytes is not None and pools is not None:
                    pool_mb, resident_mb = pools
                    memory.append(
                        MemorySample(round(now, 1), round(megabytes, 1), resident_mb, pool_mb, server.process.pid)
                    )
            if len(batch_ids) < 3 and now >= len(batch_ids) * duration / 3:
                batch_id = await asyncio.to_thread(submit_batch, server.url, keys[-1], 12, args.max_tokens)
                if batch_id:
                    batch_ids.append(batch_id)
            await asyncio.sleep(1)
        await load

    def inject(fault: str) -> dict:
        FaultWindow.on = True
        try:
            return injected(fault)
        finally:
            time.sleep(2)  # requests cut by the fault end a moment after it
            FaultWindow.on = False

    def injected(fault: str) -> dict:
        if fault == "kill -9":
            server.kill()
            began = time.monotonic()
            server.start()  # the same ledger and batch dir: unfinished batches resume
            return {"restart_s": round(time.monotonic() - began, 1)}
        if fault == "postgres down":
            home.postgres.restart(down_seconds=POSTGRES_DOWN_SECONDS)
            return {"window_s": POSTGRES_DOWN_SECONDS}
        if not home.mounted:
            return {"skipped": "could not mount a tmpfs for the ledger (not root?)"}
        filler = fill_disk(home.disk)
        time.sleep(15)
        filler.unlink()
        return {"window_s": 15}

    try:
        asyncio.run(run())
        batches = batch_results(server.url, keys[-1], batch_ids, time.monotonic() + 600)
        time.sleep(3)  # the last aborts and ledger commits settle
        kv = metric_values(server.url, "carpool:kv_cache_usage_perc")
    finally:
        server.stop()
    outcomes = {name: sum(1 for sent in log if sent.outcome == name) for name in ("whole", "left", "refused", "failed")}
    why: dict[str, int] = {}
    for sent in log:
        if sent.why:
            why[f"{sent.outcome} {sent.why}"] = why.get(f"{sent.outcome} {sent.why}", 0) + 1
    try:
        ledger = ledger_checks(home.db, log)
    finally:
        if home.postgres:
            home.postgres.stop()
    memory_report = memory_checks(memory)
    report = {
        "minutes": args.minutes,
        "db": args.db,
        "streams": args.streams,
        "requests": len(log),
        "outcomes": outcomes,
        "not_whole_why": why,
        "faults": faults,
        "batches": batches,
        "ledger": ledger,
        "idle_kv_usage": kv,
        "memory": [vars(sample) for sample in memory],
        "memory_checks": memory_report,
    }
    batch_ok = all(
        result["status"] == "completed" and all(count == 1 for count in result["answered"].values())
        for result in batches.values()
    )
    report["invariants"] = {
        "ledger": ledger["ok"],
        "batches_each_line_once": batch_ok,
        "kv_free_when_idle": bool(kv) and all(value == 0 for value in kv.values()),
        "rss_flat_outside_kv": memory_report["flat"],
        "rss_within_start_plus_pools": memory_report["bounded"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    _plot(memory, faults, out.with_suffix(".png"))
    print(_summary(report))
    if home.mounted:
        subprocess.run(["umount", str(home.disk)], capture_output=True)
    shutil.rmtree(home.root, ignore_errors=True)
    return 0 if all(report["invariants"].values()) else 1


def _plot(memory: list[MemorySample], faults: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5))
    for pid in dict.fromkeys(sample.pid for sample in memory):
        samples = [sample for sample in memory if sample.pid == pid]
        minutes = [sample.at_s / 60 for sample in samples]
        axis.plot(minutes, [sample.rss_mb for sample in samples], label=f"server RSS (pid {pid})")
        outside = [sample.rss_mb - sample.kv_resident_mb for sample in samples]
        axis.plot(minutes, outside, linestyle="--", label=f"RSS less KV pool pages (pid {pid})")
    for fault in faults:
        axis.axvline(fault["at_s"] / 60, color="red", linestyle=":", label=fault["fault"])
    axis.set_xlabel("minutes")
    axis.set_ylabel("MB")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _summary(report: dict) -> str:
    ledger = report["ledger"]
    lines = [
        f"soak: {report['minutes']:g} min, {report['streams']} streams, {report['requests']} requests {report['outcomes']}",
        f"not whole: {report['not_whole_why']}",
        "faults: " + (", ".join(f"{f['fault']} at {f['at_s']:.0f}s" for f in report["faults"]) or "none"),
        (
            f"ledger: {ledger['rows']} rows, {ledger['billed_rows']} billed, doubled {len(ledger['doubled_ids'])}, "
            f"whole without a row {len(ledger['whole_without_row'])}, billed without delivery "
            f"{len(ledger['billed_without_delivery'])}, over budget {len(ledger['over_budget'])}"
        ),
        f"batches: {[(b['status'], len(b['answered'])) for b in report['batches'].values()]}",
        f"idle KV usage: {report['idle_kv_usage']}",
        f"memory: {report['memory_checks']}",
        "invariants: " + ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in report["invariants"].items()),
    ]
    return "\n".join(lines)
