"""What the server hands to economics after every request: one plain record, no engine internals."""

from dataclasses import dataclass, field
import time


@dataclass
class UsageRecord:
    request_id: str
    model: str
    tier: str  # "priority" | "default" | "flex" | "batch"
    prompt_tokens: int  # all prompt tokens, cached ones included
    cached_tokens: int  # prompt tokens read from the prefix cache
    cache_write_tokens: int  # prompt tokens that created new prefix-cache entries
    output_tokens: int
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    key_id: str | None = None
    tenant: str | None = None
    created: float = field(default_factory=time.time)

    @property
    def uncached_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens
