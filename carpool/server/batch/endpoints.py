"""A batch line runs through the live endpoint's own code: its request model, its checks, its response body.

So a body the live endpoint refuses is refused here too, a batch response is byte for byte what a synchronous
call would have returned, and billing happens where it does for every other request (the server's Generation
hands the gate one UsageRecord, at tier `batch`, named by the line's request id). A line's `model` may name a
cascade, as a live request's may.
"""

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

from pydantic import BaseModel, ValidationError

from carpool.economics.contract import GateError, Principal
from carpool.engine.tiers import BATCH_TIER
from carpool.server.anthropic.convert import start_message
from carpool.server.anthropic.protocol import MessagesRequest
from carpool.server.batch.runner import BatchEndpoint, LineRun, Outcome
from carpool.server.batch.validation import InvalidBody
from carpool.server.cascade.runner import CascadeServing
from carpool.server.errors import APIError, error_body, field_path
from carpool.server.generation import GenerationFailed
from carpool.server.protocol import ChatCompletionRequest, CompletionRequest
from carpool.server.serving import Serving

# Refusals that mean "not now" when they come with a retry time: a full queue or a key's rate limit, and a
# ledger or (PostgreSQL) database that cannot be reached for the moment. Batch work waits its turn; every other
# refusal answers the line.
WAIT_CODES = ("rate_limit_exceeded", "ledger_unavailable", "database_unavailable")


class ServingEndpoint:
    def __init__(self, request_model: type[BaseModel], start: Callable[..., Awaitable]):
        self.request_model, self.start = request_model, start

    def check_body(self, body: dict) -> None:
        """What the live endpoint checks before it routes and tokenizes: the request model.

        Checks that need the served model (its name, the prompt's tokens, the context length) come when the line
        runs, as that line's error (a 404 or 400 in the error file): one bad line does not fail the batch, and
        validating a 50,000-line file stays cheap.
        """
        request = self._parse(body)
        if request.stream:
            raise InvalidBody("stream: a batch request is answered whole, not streamed", "stream")

    async def run(self, principal: Principal, body: dict, line: LineRun) -> Outcome:
        # The batch tier is this server's own: no request body can name it, so it is set on the parsed request.
        request = self._parse(body).model_copy(update={"service_tier": BATCH_TIER, "priority": None})
        while True:
            try:
                gen, fmt = await self.start(request, principal, line.request_id)
                break
            except (APIError, GateError) as refused:
                error = refused if isinstance(refused, APIError) else APIError.from_gate_error(refused)
                # A refusal with no retry time (a request larger than the key's per-minute limit) is "no".
                if error.code not in WAIT_CODES or error.retry_after is None:
                    return Outcome(
                        error.status, error_body(error.status, error.message, error.param, error.code), line.request_id
                    )
                await asyncio.sleep(error.retry_after)
        try:
            await gen.wait()
        except GenerationFailed as error:
            return Outcome(500, error_body(500, f"The engine failed while generating: {error}"), line.request_id)
        except GateError as error:  # the usage could not be made durable: the line must not read as a success
            return Outcome(error.status, error_body(error.status, error.message, code=error.code), line.request_id)
        finally:
            if not gen.done.is_set():  # the batch was cancelled or expired (billed: no rerun answers it), or the
                # server stops or lost the lease (not billed: the rerun is)
                if line.rerun_later():
                    gen.abandon()
                else:
                    gen.cancel()
        return Outcome(
            200, fmt.response(gen), line.request_id, gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens
        )

    def _parse(self, body: dict) -> BaseModel:
        try:
            return self.request_model.model_validate(body)
        except ValidationError as error:
            first = error.errors()[0]
            loc = list(first.get("loc", ()))
            if not loc:
                raise InvalidBody(f"body: {first.get('msg')}") from None
            raise InvalidBody(f"{field_path(loc)}: {first.get('msg')}", str(loc[0])) from None


def serving_endpoints(serving: Serving, cascades: CascadeServing) -> dict[str, BatchEndpoint]:
    """Started as the live routes start theirs: a cascade's steps in turn, else the gate's admission off the event
    loop when it asks for it."""

    async def start(start_model, request, principal: Principal, request_id: str):
        if request.model in cascades:
            gen, fmt, _ = await cascades.answer(request, principal, request_id)
            return gen, fmt
        return await serving.started(start_model, request, principal, request_id)

    return {
        "/v1/chat/completions": ServingEndpoint(ChatCompletionRequest, partial(start, serving.start_chat)),
        "/v1/completions": ServingEndpoint(CompletionRequest, partial(start, serving.start_completion)),
        # Anthropic's Message Batches (carpool.server.anthropic.batches): lines of the Messages API.
        "/v1/messages": ServingEndpoint(MessagesRequest, partial(serving.started, partial(start_message, serving))),
    }
