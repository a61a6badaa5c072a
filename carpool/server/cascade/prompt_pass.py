"""A prompt-pass router's features on the server: its cheapest model's one prefill of the request's prompt, with
per-token surprisals (the compressor's scorer, carpool.server.compression.scorer), admitted by the gate and billed
as a row of its own: an attempt of the router's step 0 that answers nothing (purpose 'cascade_attempt',
cascade_accepted false), so the cascade report counts it in the router's cost. The pass leaves the prompt's KV in
that model's prefix cache, under the request's own cache scope: when the router picks that model, its attempt
reads the prompt back from the cache instead of computing it again."""

import asyncio
import dataclasses

from carpool.economics.contract import Principal, part_request_id
from carpool.server.cascade.router import Router
from carpool.server.compression.scorer import EngineScorer
from carpool.server.protocol import ChatCompletionRequest
from carpool.server.serving import ModelServing, Serving, requested_tier

PART = "prompt-pass"  # its row's request id: part_request_id(client's id, PART)


async def prompt_pass(
    serving: Serving, router: Router, body, text: str, principal: Principal, client_request_id: str
) -> list[float]:
    """router.models[0]'s surprisal (nats) of each token after the first of the prompt that model would run for
    `body` (a chat's messages through its template, or the completion's `text`)."""
    cheapest = serving.models[router.models[0]]
    request = body.model_copy(update={"model": cheapest.model_name})
    if isinstance(request, ChatCompletionRequest):
        ids = cheapest.chat_prompt_ids(request)
    else:
        ids = cheapest._tokenize(text, request)
    tier = requested_tier(request)
    scorer = EngineScorer(cheapest.engine, cheapest.model_name, tier, ModelServing._cache_salt(request, principal))
    row_id = part_request_id(client_request_id, PART)
    cheapest.gate.admit(principal, tier, len(ids) + 1, request_id=row_id, model=cheapest.model_name)
    try:
        [surprisals] = await scorer.surprisals([ids])
    finally:  # the pass's work is billed even when it failed, and the record settles the admission
        record = dataclasses.replace(
            scorer.usage_record(principal, row_id, client_request_id),
            purpose="cascade_attempt",
            cascade=router.name,
            cascade_step=0,
            cascade_accepted=False,
        )
        durable = cheapest.gate.record(principal, record)
        if durable is not None:
            await asyncio.wrap_future(durable)
    return surprisals[1:]  # the first token has none (nothing predicts it)
