"""`carpool bench serve`: drive any OpenAI-compatible server with streaming chat requests (or, for a base model
without a chat template, plain completions: `--api completions`), a closed loop of N concurrent streams per level, and report output tokens/s, TTFT p50/p99 and ITL p50/p99 per level, as a table,
a JSON file and a PNG plot.

Prompts are the first human turns of chat_prompts.jsonl (shipped in carpool/bench/data), in file order, each
used once in the whole run: a server with a prefix cache gets no free hits from a prompt it has already seen.
TTFT runs to the first chunk carrying text (some servers send an empty role chunk at once); ITL is the gap
between consecutive text chunks; output tokens come from the usage chunk when the server sends one. Nothing is
measured until every server answers /health (READY_POLL_S below).

`--rounds N` measures the servers in turns N times, each round starting with the server the last one ended with (A B,
B A, A B, ...), every round on prompts of its own (the same for every server within it). On a shared machine the
neighbours' load drifts over the minutes one server's run takes; alternating spreads that drift over both sides, and
the report gives each round's ratios beside the pooled figures (all requests of all rounds). One 32-stream run of
Qwen2.5-Coder-1.5B against llama.cpp's server on the project's 2-core VM read 2.09-2.40x from run to run, with the
hour and which server went first; four rounds of it, 2.12-2.24x (docs/benchmarks/journal.md).
"""

import argparse
import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from carpool.bench.datasets import first_human_turns

# Each API's path and how a streamed chunk carries its text.
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

# A server may close an idle keep-alive connection as the client reuses it: llama.cpp's server did so for 3 of
# 8 single-stream requests (2026-12-03, "Server disconnected without sending a response", no task in its log),
# and those requests were counted as its errors, their work missing from its tok/s. Such a request never reached
# the server, so it is sent again, once, on a new connection (its TTFT still counts from the first send).
STALE_CONNECTION_RETRIES = 1

# Every server under test must answer /health before the first is measured: carpool's warms up every step shape
# after its port opens (its /health says 503 "warming" meanwhile), and a side-by-side begun at once measured
# llama.cpp's server beside it at 111-164 ms a token for its first two requests, 36 ms after (Qwen2.5-Coder-1.5B,
# 2026-12-04, Zen 4): the first server measured was the one slowed. A server without /health (404) is taken as ready.
READY_POLL_S = 0.5


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None
    retries: int = 0  # sends after the first (see STALE_CONNECTION_RETRIES)
    answered: bool = False  # the server sent a status line


@dataclass
class LevelReport:
    concurrency: int
    num_requests: int
    num_errors: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    errors: list[str]  # what the failed requests got back (distinct messages)
    retries: int = 0  # requests sent again after a stale keep-alive connection


def add_parser(modes) -> None:
    parser = modes.add_parser("serve", help="load-test an OpenAI-compatible server with streaming chat requests")
    parser.add_argument(
        "--url",
        action="append",
        default=None,
        help="a server's base URL; repeat to compare servers side by side in one run (default: http://127.0.0.1:8000)",
    )
    parser.add_argument("--concurrency", type=_int_list, default=[1, 8, 32], help="comma-separated stream counts")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level (default: the larger of 8 and twice the concurrency)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most")
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="skip longer prompts (for servers with small per-slot contexts)",
    )
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument(
        "--api",
        choices=ENDPOINTS,
        default="chat",
        help="chat: /v1/chat/completions with the prompt as the user turn; completions: "
        "/v1/completions with the prompt as raw text (base models have no chat template)",
    )
    parser.add_argument("--api-key", default=None, help="sent as the bearer token to every server")
    parser.add_argument(
        "--label",
        action="append",
        default=None,
        help="each server's name in the report, in --url order (default: the model)",
    )
    parser.add_argument(
        "--out", default=None, help="path prefix of the .json and .png (default: bench-results/serve-LABELS)"
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every server's /health before measuring any",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the servers in turns this many times, the order reversed each round, each "
        "round on new prompts; the report pools them and gives each round's ratios",
    )
    parser.set_defaults(func=main)


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("expected positive integers separated by commas, e.g. 1,8,32")
    return values


def checked_labels(urls: list[str], labels: list[str] | None) -> list[str]:
    """The --label values, one per --url at most (the servers without one get a default from the caller)."""
    labels = labels or []
    if len(labels) > len(urls):
        raise ValueError("label: more --label than --url values")
    return labels


def file_stem(labels: list[str]) -> str:
    """The servers' labels as one file name: "carpool-vs-llama.cpp"."""
    return "-vs-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", label) for label in labels)


def main(args: argparse.Namespace) -> int:
    urls = args.url or ["http://127.0.0.1:8000"]
    labels = checked_labels(urls, args.label)
    if args.rounds < 1:
        raise ValueError(f"rounds: expected at least 1, got {args.rounds}")
    asyncio.run(wait_until_ready(urls, args.ready_timeout))
    runs: list[list[dict]] = [[] for _ in urls]  # per server, its run in each round
    for round_index in range(args.rounds):
        for i in round_order(len(urls), round_index):
            label = labels[i] if i < len(labels) else None
            runs[i].append(asyncio.run(run(args, urls[i], label, round_index)))
    reports = [pooled(server_runs) for server_runs in runs]
    prefix = Path(args.out or f"bench-results/serve-{file_stem([r['label'] for r in reports])}")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # appended, not with_suffix: a prefix such as "serve-carpool-vs-llama.cpp" or "qwen-1.5b" has dots of its own
    json_path, png_path = (prefix.parent / f"{prefix.name}{ext}" for ext in (".json", ".png"))
    json_path.write_text(json.dumps(reports if len(reports) > 1 else reports[0], indent=2) + "\n")
    plot(reports, png_path)
    for report in reports:
        print(table(report) + "\n")
    if len(reports) > 1:
        print(comparison(reports))
    print(f"\nwrote {json_path} and {png_path}")
    return 0


def round_order(servers: int, round_index: int) -> list[int]:
    """The servers' order in a round: as given in even rounds, reversed in odd ones (A B, B A, A B, ...)."""
    order = list(range(servers))
    return order[::-1] if round_index % 2 else order


def pooled(server_runs: list[dict]) -> dict:
    """One server's report: each level's requests of every round summarized together (tokens over the summed
    durations, percentiles over all requests), and with several rounds each round's own levels under "rounds"."""
    first = server_runs[0]
    levels = [
        summarize(
            level["concurrency"],
            [r for run in server_runs for r in run["results"][i]],
            sum(run["durations"][i] for run in server_runs),
        )
        for i, level in enumerate(first["levels"])
    ]
    report = {key: value for key, value in first.items() if key not in ("levels", "results", "durations")}
    report["levels"] = [asdict(level) for level in levels]
    if len(server_runs) > 1:
        report["rounds"] = [run["levels"] for run in server_runs]
    return report


def _ratio(mine: dict, theirs: dict, key: str) -> float:
    return mine[key] / theirs[key] if mine[key] and theirs[key] else float("nan")


def comparison(reports: list[dict]) -> str:
    """The first server's figures as multiples of each other's, level by level (pooled over rounds, then each
    round's output tokens/s ratio)."""
    first = reports[0]
    lines = []
    for other in reports[1:]:
        lines.append(f"{first['label']} / {other['label']}:")
        for i, (mine, theirs) in enumerate(zip(first["levels"], other["levels"])):
            ratio = {key: _ratio(mine, theirs, key) for key in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s")}
            line = (
                f"  {mine['concurrency']:>3} streams: output tokens/s x{ratio['output_tokens_per_s']:.2f}, "
                f"TTFT p50 x{ratio['ttft_p50_s']:.2f}, ITL p50 x{ratio['itl_p50_s']:.2f}"
            )
            if "rounds" in first:
                by_round = [_ratio(a[i], b[i], "output_tokens_per_s") for a, b in zip(first["rounds"], other["rounds"])]
                line += "; output tokens/s by round " + " ".join(f"x{r:.2f}" for r in by_round)
            lines.append(line)
    return "\n".join(lines)


async def wait_until_ready(urls: list[str], timeout: float) -> None:
    """Return once every server answers /health with 200 (or has no /health); a TimeoutError names one that never
    did within `timeout` seconds, with its last answer."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        for url in urls:
            while True:
                try:
                    response = await client.get(f"{url.rstrip('/')}/health")
                    if response.status_code in (200, 404):
                        break
                    last = f"HTTP {response.status_code} {response.text[:200]}"
                except httpx.HTTPError as error:  # not listening yet
                    last = repr(error)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} was not ready within {timeout:g} s (/health: {last})")
                await asyncio.sleep(READY_POLL_S)


async def run(args: argparse.Namespace, url: str, label: str | None, round_index: int = 0) -> dict:
    """One server's run of every level in one round: the report's fields, each level's summary ("levels"), and
    its requests and duration ("results", "durations") for pooling over rounds."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = args.concurrency
    counts = [args.num_requests or max(8, 2 * c) for c in levels]
    per_round = 1 + sum(counts)
    needed = per_round * (round_index + 1)
    prompts = first_human_turns(needed, max_chars=args.max_prompt_chars)
    if len(prompts) < needed:
        raise ValueError(f"num-requests: only {len(prompts)} prompts available, {needed} needed")
    prompts = prompts[per_round * round_index :]
    limits = httpx.Limits(max_connections=max(levels) + 1, max_keepalive_connections=max(levels) + 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = args.model or await _first_model(client)
        warmup = await _one_request(client, model, prompts.pop(0), args.max_tokens, args.api)
        if not warmup.ok:
            raise RuntimeError(f"the warm-up request failed: {warmup.error}")
        results, durations, summaries = [], [], []
        for concurrency, count in zip(levels, counts):
            level_prompts, prompts = prompts[:count], prompts[count:]
            level_results, duration = await _run_level(
                client, model, level_prompts, concurrency, args.max_tokens, args.api
            )
            results.append(level_results)
            durations.append(duration)
            summaries.append(summarize(concurrency, level_results, duration))
            print(
                f"{label or model}, round {round_index + 1}, concurrency {concurrency}: "
                f"{summaries[-1].output_tokens_per_s:.1f} output tokens/s",
                flush=True,
            )
    return {
        "url": url,
        "model": model,
        "label": label or model,
        "max_tokens": args.max_tokens,
        "api": args.api,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": [asdict(summary) for summary in summaries],
        "results": results,
        "durations": durations,
    }


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _run_level(
    client, model: str, prompts: list[str], concurrency: int, max_tokens: int, api: str
) -> tuple[list[RequestResult], float]:
    """Every prompt sent by `concurrency` streams in a closed loop: the requests' results and the seconds taken."""
    pending = list(reversed(prompts))
    results: list[RequestResult] = []

    async def stream_worker():
        while pending:
            results.append(await _one_request(client, model, pending.pop(), max_tokens, api))

    start = time.perf_counter()
    await asyncio.gather(*(stream_worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def _chunk_text(choice: dict) -> str | None:
    return (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")


async def _one_request(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, api: str = "chat"
) -> RequestResult:
    body = {
        "model": model,
        **({"messages": [{"role": "user", "content": prompt}]} if api == "chat" else {"prompt": prompt}),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    for attempt in range(1 + STALE_CONNECTION_RETRIES):
        result = RequestResult(ok=False, retries=attempt)
        try:
            await stream_into(result, client, ENDPOINTS[api], body, start)
        except httpx.RemoteProtocolError as error:
            result.error = repr(error)
            if result.answered:
                return result
            continue
        except httpx.HTTPError as error:
            result.error = repr(error)
        return result
    return result


async def stream_into(result: RequestResult, client: httpx.AsyncClient, path: str, body: dict, start: float) -> None:
    """One attempt at one request: TTFT and ITL count from `start`, the first attempt's send."""
    text_chunks, last = 0, None
    async with client.stream("POST", path, json=body) as response:
        result.answered = True
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            now = time.perf_counter()
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if any(_chunk_text(c) for c in chunk.get("choices") or []):
                text_chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    result.output_tokens = result.output_tokens or text_chunks
    result.ok = True


def summarize(concurrency: int, results: list[RequestResult], duration: float) -> LevelReport:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    return LevelReport(
        concurrency=concurrency,
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        duration_s=duration,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        errors=sorted({r.error for r in results if not r.ok and r.error}),
        retries=sum(r.retries for r in results),
    )


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def latency_summary(ttft: list[float], itl: list[float]) -> dict:
    """Time to first token and between tokens, p50 and p99 (None where there is nothing to take them of): the
    shape every report and prediction of latency shares, so they compare key for key."""
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
    }


def table(report: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [
        f"{report['label']} at {report['url']}, {report.get('api', 'chat')}, max_tokens {report['max_tokens']}, greedy",
        (
            f"{'streams':>7} {'requests':>8} {'errors':>6} {'resent':>6} {'out tok/s':>9} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}   (latencies in ms)"
        ),
    ]
    for level in report["levels"]:
        lines.append(
            f"{level['concurrency']:>7} {level['num_requests']:>8} {level['num_errors']:>6} "
            f"{level.get('retries', 0):>6} {level['output_tokens_per_s']:>9.1f} {ms(level['ttft_p50_s']):>9} "
            f"{ms(level['ttft_p99_s']):>9} "
            f"{ms(level['itl_p50_s']):>8} {ms(level['itl_p99_s']):>8}"
        )
    return "\n".join(lines)


def plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, ttft, itl) = plt.subplots(1, 3, figsize=(13, 4))
    for color, report in enumerate(reports):
        style = {"color": f"C{color}", "marker": "o"}  # one colour per server; p99 dashed
        levels = report["levels"]
        x = [level["concurrency"] for level in levels]

        def series(key):
            return [np.nan if level[key] is None else level[key] * 1000 for level in levels]

        throughput.plot(x, [level["output_tokens_per_s"] for level in levels], label=report["label"], **style)
        for axis, name in ((ttft, "ttft"), (itl, "itl")):
            axis.plot(x, series(f"{name}_p50_s"), label=f"{report['label']} p50", **style)
            axis.plot(x, series(f"{name}_p99_s"), linestyle="--", label=f"{report['label']} p99", **style)
    throughput.set(title="output tokens/s", xlabel="concurrent streams")
    for axis, name in ((ttft, "TTFT"), (itl, "ITL")):
        axis.set(title=f"{name} (ms)", xlabel="concurrent streams")
    x = [level["concurrency"] for level in reports[0]["levels"]]
    for axis in (throughput, ttft, itl):
        axis.legend(fontsize=7)
        axis.set_xscale("log", base=2)
        axis.set_xticks(x, [str(v) for v in x])
        axis.grid(alpha=0.3)
    labels = " vs ".join(r["label"] for r in reports)
    figure.suptitle(
        f"{labels}: streaming {reports[0].get('api', 'chat')}, max_tokens {reports[0]['max_tokens']}, greedy"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
