import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum, auto

from carpool.engine.request import CacheBreakpoint
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.tiers import BY_NAME, DEFAULT_TIER


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the most likely alternatives, best first
    rank: int | None = None  # the token's rank among all tokens (1: the likeliest), where it is computed


@dataclass
class SequenceTimes:
    """Wall-clock marks of a request's life, read by metrics and the ledger."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


_counter = itertools.count()


class Sequence:
    """One request inside the engine: its tokens, how many have KV in the cache, and the blocks holding it.

    All tokens (prompt + output) live in `token_ids`; `num_computed_tokens` of them have KV in the cache.
    Preemption resets that count to 0 and the next schedule recomputes prompt and outputs alike.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = BY_NAME[DEFAULT_TIER].priority,
        cache_salt: str | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
        arrival: float | None = None,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ):
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)  # shared, never copied, by every output of the request
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.bad_words_token_ids = bad_words_token_ids or []  # params.bad_words as token ids (see LLMEngine)
        # Every request samples from its own seeded stream, so its tokens don't depend on its batch-mates
        # or on being preempted and recomputed.
        self.sampling_seed = params.seed if params.seed is not None else random.getrandbits(62)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.sliding_block_table: list[int] = []  # the sliding-window layers' blocks, if the model has such layers
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of token_ids, filled lazily
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_cache_write_tokens = 0  # prompt tokens whose blocks this request added to the prefix cache
        # Prefixes to pin (BlockManager.pin_breakpoints): how many breakpoints were settled (pinned or refused), the
        # block their pins reach, the prompt tokens written under a pin by its TTL (moved out of
        # num_cache_write_tokens), and the indices of the blocks this request registered in the cache.
        self.cache_breakpoints = cache_breakpoints
        self.num_pinned_breakpoints = 0
        self.pinned_through_block = 0
        self.cache_write_tokens_by_ttl: Counter = Counter()
        self.written_blocks: set[int] = set()
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        # params.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it) and for those
        # before params.prompt_logprobs_start; filled as prefill chunks run, and not again when a preemption
        # recomputes them.
        self.prompt_logprobs: list[TokenLogprob | None] = [None] * max(
            1, min(params.prompt_logprobs_start, self.num_prompt_tokens)
        )
        self.cumulative_logprob = 0.0  # of the output tokens, kept when params.logprobs or params.ranked ask
        self.output_text = ""
        # Speculative decoding, for one step: how many draft tokens the scheduler reserves KV slots for, the
        # drafts proposed into them, and the draft's probability rows they were sampled from (None: each draft
        # is a point mass, as n-gram lookup and greedy drafting propose).
        self.num_lookahead_tokens = 0
        self.spec_token_ids: list[int] = []
        self.spec_probs = None
        self.times = SequenceTimes() if arrival is None else SequenceTimes(arrival=arrival)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.name})"
        )
