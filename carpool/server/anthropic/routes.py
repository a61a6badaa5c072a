"""`POST /v1/messages` and `POST /v1/messages/count_tokens`, through the chat route's pipeline (convert.py).

Keys come as `x-api-key` or `Authorization: Bearer` (carpool.server.auth), the same keys as the OpenAI routes';
`anthropic-version` is accepted whatever it says, and `anthropic-beta` flags are not acted on: every feature this
server has is on without them. Bodies are parsed here, not by FastAPI, so a bad field's 400 names it as the
Messages API does (carpool.server.anthropic.protocol.parse).
"""

import asyncio
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from carpool.economics.contract import Gate
from carpool.server.anthropic.batches import create_message_batches_router
from carpool.server.anthropic.convert import checked_chat_request, count_tokens, start_message
from carpool.server.anthropic.errors import openapi
from carpool.server.anthropic.protocol import CountTokensRequest, MessagesRequest, json_body, parse
from carpool.server.anthropic.stream import message_events
from carpool.server.batch.service import BatchService
from carpool.server.disconnect import CLIENT_CLOSED_REQUEST, disconnected, finished_before_disconnect
from carpool.server.errors import APIError
from carpool.server.generation import GenerationFailed
from carpool.server.serving import ClientLeft, Serving


def anthropic_routers(serving: Serving, batches: BatchService | None, gate: Gate) -> list[APIRouter]:
    """The Messages API's routers; Message Batches only where the server has a batch home."""
    routers = [create_messages_router(serving)]
    if batches:
        routers.append(create_message_batches_router(batches, gate))
    return routers


def create_messages_router(serving: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", response_model=None, **openapi(403, 404, 429, 499, 503, body=MessagesRequest))
    async def messages(request: Request) -> Response:
        body = parse(MessagesRequest, await json_body(request))
        await serving.precompile(checked_chat_request(body))  # off the event loop, as the chat route does
        try:
            gen, fmt = await serving.started(
                partial(start_message, serving),
                body,
                request.state.principal,
                request.state.request_id,
                lambda: disconnected(request),
            )
        except ClientLeft:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if body.stream:
            return StreamingResponse(
                message_events(gen, fmt),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(gen.cancel),
            )
        if not await finished_before_disconnect(request, gen):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            await gen.wait()
        except GenerationFailed as error:
            raise APIError(500, f"The engine failed while generating: {error}") from error
        return JSONResponse(fmt.response(gen))

    @router.post("/v1/messages/count_tokens", **openapi(404, body=CountTokensRequest))
    async def messages_count_tokens(request: Request) -> dict:
        body = parse(CountTokensRequest, await json_body(request))
        # A chat template over a long conversation and its tokenizing take milliseconds: off the event loop.
        return await asyncio.to_thread(count_tokens, serving, body)

    return router
