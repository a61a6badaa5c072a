from dataclasses import dataclass, field

from carpool.engine.sequence import SequenceTimes, TokenLogprob


@dataclass
class RequestOutput:
    """A request's state after a step: the whole output so far, and what is new since the last report."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort"
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # when params.logprobs or params.ranked asked for it
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when params.prompt_logprobs asked (first: None)
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0  # automatic writes: prompt tokens cached without a pin
    # Prompt tokens written under a cache breakpoint's pin, by its TTL in seconds (not in num_cache_write_tokens).
    cache_write_tokens_by_ttl: dict[float, int] = field(default_factory=dict)
    num_preemptions: int = 0
    times: SequenceTimes | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def best_of(outputs: list[RequestOutput], n: int = 1) -> list[RequestOutput]:
    """The n outputs with the highest cumulative logprob, best first (outputs of params.ranked requests)."""
    return sorted(outputs, key=lambda output: output.cumulative_logprob, reverse=True)[:n]
