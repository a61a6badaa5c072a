"""`carpool bench prefix`: what automatic prefix caching saves, cache on vs off, in one run.

Two workloads, each sent one request at a time (so TTFT is pure prefill, not queueing):
  chat  multi-turn conversations from chat_prompts.jsonl, replayed turn by turn (recorded replies as history)
        behind one shared system prompt of --system-tokens tokens;
  docs  meeting transcripts from long_docs.jsonl, each asked its several questions (grouped by meeting_id).
Reported per workload and mode: TTFT p50/p99 and the prompt tokens actually computed (not served from cache).
"""

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from carpool.bench.datasets import conversations, long_docs
from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def add_parser(modes) -> None:
    parser = modes.add_parser("prefix", help="prefix caching on vs off: TTFT and prompt tokens computed")
    parser.add_argument("--conversations", type=int, default=12, help="multi-turn chats in the chat workload")
    parser.add_argument("--system-tokens", type=int, default=1200, help="length of the system prompt every chat shares")
    parser.add_argument(
        "--meetings", type=int, default=4, help="transcripts in the docs workload, each asked its questions"
    )
    parser.add_argument("--max-doc-words", type=int, default=1500, help="skip longer transcripts")
    parser.add_argument(
        "--cached-prefix-tokens", type=int, default=2000, help="the long cached prefix whose TTFT is compared"
    )
    parser.add_argument("--out", default="bench-results/prefix.json", help="where the JSON report goes")
    parser.set_defaults(func=main)


def shared_system_prompt(engine: LLMEngine, num_tokens: int) -> str:
    """A long, real system prompt: house rules followed by a reference transcript, cut to num_tokens."""
    transcript = next(iter(long_docs()))["document"]
    rules = "You are a careful assistant for a product team. Use the reference transcript when relevant.\n\n"
    tokens = engine.tokenizer.encode(rules + "Reference transcript:\n" + transcript * 4)
    return engine.tokenizer.decode(tokens[:num_tokens])


def chat_requests(engine: LLMEngine, count: int, system_tokens: int) -> list[list[int]]:
    system = shared_system_prompt(engine, system_tokens)
    requests = []
    multi_turn = (c for c in conversations() if len(c) >= 4)
    for _, chat in zip(range(count), multi_turn):
        history = [{"role": "system", "content": system}]
        for turn in range(0, len(chat) - 1, 2):
            history.append({"role": "user", "content": chat[turn]["content"][:1500]})
            requests.append(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(history)))
            history.append({"role": "assistant", "content": chat[turn + 1]["content"][:1500]})
    return requests


def doc_requests(engine: LLMEngine, meetings: int, max_words: int) -> list[list[int]]:
    by_meeting = defaultdict(list)
    for record in long_docs():
        if record["doc_words"] <= max_words:
            by_meeting[record["meeting_id"]].append(record)
    chosen = sorted(by_meeting.values(), key=len, reverse=True)[:meetings]
    requests = []
    for records in chosen:
        document = max(records, key=lambda r: r["doc_words"])["document"]
        for record in records:
            messages = [{"role": "user", "content": f"{document}\n\nQuestion: {record['question_or_instruction']}"}]
            requests.append(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages)))
    return requests


def replay(engine: LLMEngine, requests: list[list[int]]) -> dict:
    ttfts, computed = [], 0
    for i, prompt in enumerate(requests):
        start = time.perf_counter()
        engine.add_request(f"prefix-bench-{i}", prompt, FIRST_TOKEN)
        while engine.has_unfinished_requests():
            for output in engine.step():
                ttfts.append(time.perf_counter() - start)
                computed += output.num_prompt_tokens - output.num_cached_tokens
    return {
        "requests": len(requests),
        "prompt_tokens": sum(map(len, requests)),
        "prompt_tokens_computed": computed,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
    }


def main(args: argparse.Namespace) -> int:
    engines = {
        "on": LLMEngine(EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=2048)),
        "off": LLMEngine(EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=2048)),
    }
    reference = engines["on"]
    workloads = {
        "chat": chat_requests(reference, args.conversations, args.system_tokens),
        "docs": doc_requests(reference, args.meetings, args.max_doc_words),
    }
    report = {}
    for name, requests in workloads.items():
        report[name] = {mode: replay(engine, requests) for mode, engine in engines.items()}
        on, off = report[name]["on"], report[name]["off"]
        report[name]["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
        report[name]["prefill_compute_reduction"] = off["prompt_tokens_computed"] / on["prompt_tokens_computed"]
        print(
            f"{name:5} {on['requests']} requests, {on['prompt_tokens']} prompt tokens | "
            f"TTFT p50 off {off['ttft_p50_s']:.3f}s on {on['ttft_p50_s']:.3f}s (x{report[name]['ttft_p50_speedup']:.1f}) | "
            f"p99 off {off['ttft_p99_s']:.3f}s on {on['ttft_p99_s']:.3f}s | "
            f"computed off {off['prompt_tokens_computed']} on {on['prompt_tokens_computed']} "
            f"(x{report[name]['prefill_compute_reduction']:.1f} less)",
            flush=True,
        )
    report["cached_prefix"] = cached_prefix_ttft(engines, args.cached_prefix_tokens)
    print(
        "{tokens}-token cached prefix: TTFT off {off:.3f}s on {on:.3f}s (x{speedup:.1f})".format(
            **report["cached_prefix"]
        )
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


def cached_prefix_ttft(engines: dict[str, LLMEngine], num_tokens: int, repeats: int = 5) -> dict:
    """TTFT of a short question behind a long prefix that the cache already holds (median of repeats)."""
    engine = engines["on"]
    prefix = engine.tokenizer.encode(shared_system_prompt(engine, num_tokens))[:num_tokens]
    questions = [
        engine.tokenizer.encode(f"\nQuestion {i}: who spoke first, and about what?") for i in range(repeats + 1)
    ]
    results = {}
    for mode, eng in engines.items():
        replay(eng, [prefix + questions[0]])  # warm: the prefix is now in the cache (when it is on)
        results[mode] = replay(eng, [prefix + q for q in questions[1:]])["ttft_p50_s"]
    return {
        "tokens": len(prefix),
        "off": results["off"],
        "on": results["on"],
        "speedup": results["off"] / results["on"],
    }
