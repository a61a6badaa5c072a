"""`carpool bench prefill`: prompt tokens per second on long prompts (prefill, compute-bound), servers side by
side in one run.

Each prompt is a distinct meeting transcript from long_docs.jsonl cut to --prompt-chars (8,400 characters: about
2,000 tokens of them for the supported models' tokenizers), sent as a raw /v1/completions prompt with max_tokens
1, one request at a time. The servers take turns prompt by prompt, so a machine's swings hit each alike. A
request's time is its prefill plus one decode step and the HTTP round trip; its prompt tok/s is the prompt tokens
the server counted (usage) over that time, and the report takes the median over the prompts after a warm-up one.
Every prompt is new to every server: no prefix-cache hits.

    carpool bench prefill --url http://127.0.0.1:8101 --label carpool --url http://127.0.0.1:8102 --label llama.cpp
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from carpool.bench.datasets import long_docs
from carpool.bench.serve import checked_labels, file_stem


def add_parser(modes) -> None:
    parser = modes.add_parser("prefill", help="prompt tok/s on long prompts (prefill), servers side by side")
    parser.add_argument(
        "--url",
        action="append",
        required=True,
        help="a server's base URL; repeat to compare servers side by side in one run",
    )
    parser.add_argument("--label", action="append", default=None, help="each server's name, in --url order")
    parser.add_argument("--prompts", type=int, default=5, help="timed prompts per server, after one warm-up")
    parser.add_argument("--prompt-chars", type=int, default=8400, help="characters of each transcript sent")
    parser.add_argument("--model", default=None, help="default: the first model each server lists")
    parser.add_argument("--api-key", default=None, help="sent as the bearer token to every server")
    parser.add_argument("--out", default=None, help="the JSON report (default: bench-results/prefill-LABELS.json)")
    parser.set_defaults(func=main)


def distinct_documents(count: int, chars: int) -> list[str]:
    """The first `count` transcripts at least `chars` long, cut to `chars`; records share meetings, not kept twice."""
    prompts: list[str] = []
    for record in long_docs():
        text = record["document"][:chars]
        if len(text) == chars and text not in prompts:
            prompts.append(text)
            if len(prompts) == count:
                return prompts
    raise ValueError(f"prompts: only {len(prompts)} transcripts of {chars}+ characters, {count} needed")


def prefill(client: httpx.Client, model: str, prompt: str) -> tuple[int, float]:
    """(prompt tokens the server counted, seconds) for one prompt and one output token."""
    start = time.perf_counter()
    response = client.post(
        "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    )
    seconds = time.perf_counter() - start
    response.raise_for_status()
    return response.json()["usage"]["prompt_tokens"], seconds


def main(args: argparse.Namespace) -> int:
    if args.prompts < 1:
        raise ValueError("prompts: must be at least 1")
    labels = checked_labels(args.url, args.label)
    labels = labels + args.url[len(labels) :]
    prompts = distinct_documents(1 + args.prompts, args.prompt_chars)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    clients = [httpx.Client(base_url=url, headers=headers, timeout=600.0) for url in args.url]
    try:
        models = [
            args.model or client.get("/v1/models").raise_for_status().json()["data"][0]["id"] for client in clients
        ]
        samples: list[list[tuple[int, float]]] = [[] for _ in clients]
        for i, prompt in enumerate(prompts):
            for client, model, kept in zip(clients, models, samples):
                measured = prefill(client, model, prompt)
                if i:  # the first prompt warms each server up
                    kept.append(measured)
    finally:
        for client in clients:
            client.close()
    reports = [report(label, url, model, kept) for label, url, model, kept in zip(labels, args.url, models, samples)]
    path = Path(args.out or f"bench-results/prefill-{file_stem(labels)}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reports, indent=2) + "\n")
    print(table(reports))
    print(f"\nwrote {path}")
    return 0


def report(label: str, url: str, model: str, samples: list[tuple[int, float]]) -> dict:
    return {
        "label": label,
        "url": url,
        "model": model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prompts": len(samples),
        "prompt_tokens_median": statistics.median(tokens for tokens, _ in samples),
        "seconds_median": statistics.median(seconds for _, seconds in samples),
        "prompt_tokens_per_s": statistics.median(tokens / seconds for tokens, seconds in samples),
    }


def table(reports: list[dict]) -> str:
    first = reports[0]["prompt_tokens_per_s"]
    lines = [
        "| server | prompts | prompt tokens | seconds (median) | prompt tok/s (median) | first / this |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        lines.append(
            f"| {r['label']} | {r['prompts']} | {r['prompt_tokens_median']:.0f} | {r['seconds_median']:.3f} "
            f"| {r['prompt_tokens_per_s']:.1f} | {first / r['prompt_tokens_per_s']:.2f}x |"
        )
    return "\n".join(lines)
