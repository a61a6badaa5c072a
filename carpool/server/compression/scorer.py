"""The compressor's scorer: a served model's per-token surprisal, from its engine's prompt logprobs, with the
compute it spent counted so that the ledger can bill it (a row of its own, purpose 'compression')."""

import asyncio
import dataclasses
import math
import time
import uuid

from carpool.economics.contract import Principal, UsageRecord
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.sampling_params import SamplingParams
from carpool.server.compression.compressor import Scorer

# One output token is the least a request may ask for; it is billed like any output token.
_SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)


class EngineScorer(Scorer):
    def __init__(self, engine: AsyncEngine, model_name: str, tier: str, cache_salt: str | None = None):
        """`cache_salt`: whose cached prefixes its requests may read (the client request's scope, see Serving)."""
        self.engine, self.model_name, self.tier, self.cache_salt = engine, model_name, tier, cache_salt
        self.tokenizer = engine.engine.tokenizer
        self.max_tokens = engine.engine.door.max_request_tokens - _SCORE.max_tokens
        self.request_id = f"compress-{uuid.uuid4().hex}"  # names its engine requests
        self.prompt_tokens = self.cached_tokens = self.output_tokens = 0
        self.seconds = 0.0

    async def surprisals(self, prompts: list[list[int]], starts: list[int] | None = None) -> list[list[float]]:
        """All prompts at once: the engine batches them in its steps. The positions before a prompt's start get
        no logprob (math.inf), so the engine may serve their KV from its prefix cache."""
        start = time.monotonic()
        batch = uuid.uuid4().hex[:8]
        params = [
            dataclasses.replace(_SCORE, prompt_logprobs_start=max(1, first)) for first in starts or [1] * len(prompts)
        ]
        requests = [
            self.engine.door.request(f"{self.request_id}-{batch}-{i}", ids, p, self.tier, self.cache_salt)
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        try:
            outputs = await asyncio.gather(*(self._last(request) for request in requests))
        finally:  # prompts handed to the engine are billed, also when scoring them failed
            self.seconds += time.monotonic() - start
            self.prompt_tokens += sum(len(ids) for ids in prompts)
        self.output_tokens += sum(len(output.token_ids) for output in outputs)
        self.cached_tokens += sum(output.num_cached_tokens for output in outputs)
        return [
            [math.inf if entry is None else -entry.logprob for entry in output.prompt_logprobs] for output in outputs
        ]

    async def _last(self, request):
        last = None
        async for output in self.engine.generate(request):
            last = output
        return last

    def usage_record(self, principal: Principal, request_id: str, parent_request_id: str) -> UsageRecord:
        """`request_id`: the row's (contract.part_request_id of the client's request, `parent_request_id`)."""
        return UsageRecord(
            request_id=request_id,
            model=self.model_name,
            tier=self.tier,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            cache_write_tokens=0,
            output_tokens=self.output_tokens,
            queue_seconds=0.0,
            prefill_seconds=self.seconds,
            decode_seconds=0.0,
            finish_reason="stop",
            key_id=principal.key_id,
            tenant=principal.tenant,
            purpose="compression",
            parent_request_id=parent_request_id,
        )
