"""Warm start: run every shape of step the engine will run once, before the first real request.

The first step of a new shape pays for what later ones reuse: the KV pool's pages faulted in on first touch,
oneDNN's matmul primitives built per shape, OpenMP's thread team started, the rotary tables grown, the
sampler's first allocations. Without this, a server's first request pays all of it in its time to first token.

The warm-up runs on the engine thread (the one that will serve, so its OpenMP team is the one warmed) straight
through `LLMEngine.step()`, so no step listener or metric ever sees it. Its requests carry a cache salt no
real request can have (real salts are scoped by the API key), so their cached blocks never match a real prompt.
"""

import itertools
import logging
import time
from dataclasses import dataclass

from carpool.engine.llm_engine import LLMEngine
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.tiers import DEFAULT_TIER

logger = logging.getLogger(__name__)

WARMUP_SALT = "\x00carpool-warmup"
SHORT_PROMPT_TOKENS = 3
_runs = itertools.count()
DECODE_STEPS = 2  # the second decode of each size runs on warm buffers: two prove the shape is steady


@dataclass
class WarmupReport:
    batch_sizes: list[int]  # the decode batch sizes run (sequences per step)
    long_prefill_tokens: int  # the one prompt as long as a step's token budget
    steps: int
    seconds: float
    # The best output tokens a second of its decode-only steps, for the start-up price check (carpool.economics.
    # suggested_prices.below_cost): the best, not the largest batch's, since a step's first runs are cold (on 2
    # loaded cores the 32-sequence batch decoded in 303 ms, then 1,268 ms); so the cost it implies is a floor.
    # None if no step decoded alone.
    decode_tokens_per_second: float | None = None


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two up to max_num_seqs, and max_num_seqs itself: the batch sizes a busy server steps through."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def warm_up(engine: LLMEngine) -> WarmupReport:
    """One prompt as long as a step's token budget (the large-matmul prefill path), decoded alone; then, for each
    decode batch size, that many short prompts prefilled in one step and decoded together."""
    start = time.monotonic()
    vocab = engine.model_config.vocab_size
    salt = f"{WARMUP_SALT}-{next(_runs)}"  # a fresh one per run: an earlier run's cached blocks never hit
    long_tokens = min(engine.config.max_num_batched_tokens, engine.door.max_request_tokens - DECODE_STEPS - 1)
    sizes = decode_batch_sizes(engine.config.max_num_seqs)
    greedy = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.8, top_p=0.9, ignore_eos=True)
    rounds = [[("warmup-long", [(7 * j + 1) % vocab for j in range(long_tokens)], greedy)]] if long_tokens > 0 else []
    for index, size in enumerate(sizes):
        rounds.append(
            [
                (
                    f"warmup-{size}-{i}",
                    [(index * 131 + i * SHORT_PROMPT_TOKENS + j) % vocab for j in range(SHORT_PROMPT_TOKENS)],
                    greedy if i % 2 else sampled,
                )
                for i in range(size)
            ]
        )
    steps, decode_rate = 0, None
    for requests in rounds:
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params, DEFAULT_TIER, salt)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            last = engine.last_step
            if last is not None and last.num_prefill_tokens == 0 and last.num_decode_tokens and last.duration > 0:
                decode_rate = max(decode_rate or 0.0, last.num_decode_tokens / last.duration)
    report = WarmupReport(sizes, max(long_tokens, 0), steps, time.monotonic() - start, decode_rate)
    logger.info(
        "warm-up: decode batch sizes %s and a %d-token prefill in %d steps, %.2f s",
        report.batch_sizes,
        report.long_prefill_tokens,
        report.steps,
        report.seconds,
    )
    return report
