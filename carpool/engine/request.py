"""A request as the engine takes it, checked once at its door."""

import time
from dataclasses import dataclass, field

from carpool.engine.sampling_params import SamplingParams
from carpool.engine.tiers import BY_NAME, DEFAULT_TIER


@dataclass(frozen=True)
class CacheBreakpoint:
    """Keep the prompt's first `num_tokens` tokens cached for `ttl_seconds` (300 or 3600 on the Anthropic route),
    renewed by every request that reads them: their full KV blocks are pinned, out of LRU eviction's reach
    (carpool.engine.block_manager). The pins live in the prefix cache that every route shares, under the tenant's
    salt: a prefix pinned through /v1/messages is read by /v1/chat/completions (automatic caching) when the tenant
    salt and the tokens match, and such a read renews the pin as any hit does."""

    num_tokens: int
    ttl_seconds: float


MAX_CACHE_BREAKPOINTS = 4


@dataclass(frozen=True)
class EngineRequest:
    """Made by `LLMEngine.request()` (or `AsyncEngine.request()`, the same door on the server's thread), which
    checks everything about it that can be wrong: the prompt's token ids are in the vocabulary, prompt plus
    max_tokens fit the context window and the KV pool, the params name only tokens the model has. Nothing past
    the door checks it again: it crosses to the engine thread as it is and becomes a Sequence there."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tier: str = DEFAULT_TIER
    cache_salt: str | None = None  # whose cached prefixes it may reuse (None: the shared cache)
    arrival_time: float = field(default_factory=time.monotonic)  # when it came to the door, for queue time
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words as the model spells them
    # Prefixes to pin, ascending; the door drops those shorter than the engine's cache_min_tokens.
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()

    @property
    def priority(self) -> int:
        """The scheduler's number for its tier: lower is served first."""
        return BY_NAME[self.tier].priority


def check_cache_breakpoints(breakpoints, num_prompt_tokens: int, min_tokens: int) -> tuple[CacheBreakpoint, ...]:
    """The breakpoints a request may pin; ValueError naming `cache_breakpoints` unless each lies within the
    prompt, they ascend, there are at most MAX_CACHE_BREAKPOINTS and no TTL is longer than the one before it
    (Anthropic's rules). Those shorter than `min_tokens` (the price sheet's minimum cacheable prefix) are dropped:
    such a prefix is cached as any other, never pinned nor billed as a TTL write."""
    if not isinstance(breakpoints, (tuple, list)) or not all(isinstance(b, CacheBreakpoint) for b in breakpoints):
        raise ValueError("cache_breakpoints must be a sequence of CacheBreakpoint")
    if len(breakpoints) > MAX_CACHE_BREAKPOINTS:
        raise ValueError(f"cache_breakpoints: at most {MAX_CACHE_BREAKPOINTS} breakpoints, got {len(breakpoints)}")
    previous = None
    for i, point in enumerate(breakpoints):
        where = f"cache_breakpoints[{i}]"
        if isinstance(point.num_tokens, bool) or not isinstance(point.num_tokens, int):
            raise ValueError(f"{where}.num_tokens must be an integer, got {point.num_tokens!r}")
        if not 0 < point.num_tokens <= num_prompt_tokens:
            raise ValueError(
                f"{where}.num_tokens must be within the prompt's {num_prompt_tokens} tokens, got {point.num_tokens}"
            )
        ttl = point.ttl_seconds
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < float("inf"):
            raise ValueError(f"{where}.ttl_seconds must be a positive number of seconds, got {ttl!r}")
        if previous is not None and point.num_tokens <= previous.num_tokens:
            raise ValueError(f"{where}: breakpoints must ascend ({point.num_tokens} after {previous.num_tokens})")
        if previous is not None and ttl > previous.ttl_seconds:
            raise ValueError(
                f"{where}: a longer TTL ({ttl:g} s) may not follow a shorter one ({previous.ttl_seconds:g} s)"
            )
        previous = point
    return tuple(point for point in breakpoints if point.num_tokens >= min_tokens)
