"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`: the Responses API over the chat pipeline (Serving.
start_chat: its tools, grammars, tiers, gate and ledger), with stored responses private to their API key."""

import asyncio
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from carpool.economics.contract import Principal
from carpool.server.auth import request_principal
from carpool.server.disconnect import CLIENT_CLOSED_REQUEST, disconnected, finished_before_disconnect
from carpool.server.errors import APIError
from carpool.server.generation import GenerationFailed
from carpool.server.responses_api.convert import (
    ITEMS,
    chat_request,
    finished_status,
    input_items,
    listed_item,
    output_items,
    renamed,
    response_body,
)
from carpool.server.responses_api.protocol import Item, ResponsesRequest
from carpool.server.responses_api.store import ResponseStore
from carpool.server.responses_api.stream import ResponseEvents
from carpool.server.serving import ClientLeft, Serving

Caller = Annotated[Principal, Depends(request_principal)]
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
NOT_FOUND = {404: {"description": "No response of this id for this key (or no such model)", "content": _ERROR}}


def create_responses_router(serving: Serving, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", response_model=None, responses=NOT_FOUND)
    async def create_response(body: ResponsesRequest, request: Request, caller: Caller) -> Response:
        context = await _earlier(store, caller, body.previous_response_id) + input_items(body)
        chat = chat_request(body, context)
        try:
            await serving.precompile(chat)
            gen, fmt = await serving.started(
                serving.start_chat, chat, caller, request.state.request_id, lambda: disconnected(request)
            )
        except APIError as error:
            raise renamed(error) from error
        except ClientLeft:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

        async def finish(response: dict) -> None:
            if body.store is not False:
                await _save(store, caller, response, context)

        if body.stream:
            # The background task covers a stream that never started; otherwise the stream cancels on its way out.
            return StreamingResponse(
                ResponseEvents(body, gen, fmt, finish).events(),
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
        [choice] = fmt.response(gen)["choices"]
        status = finished_status(choice["finish_reason"])
        response = response_body(body, gen, status, output_items(gen, choice), int(time.time()))
        await finish(response)
        return JSONResponse(response)

    @router.get("/v1/responses/{response_id}", responses=NOT_FOUND)
    async def get_response(response_id: str, caller: Caller) -> dict:
        return (await _stored(store, caller, response_id, "response_id"))[0]

    @router.get("/v1/responses/{response_id}/input_items", responses=NOT_FOUND)
    async def list_input_items(
        response_id: str,
        request: Request,
        caller: Caller,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict:
        """The items the response answered (a previous_response_id chain's earlier turns included), newest first
        unless `order=asc`, a page of `limit` after the item `after`. Any other query parameter is a 400: `include`
        (`include[]` as the SDK sends it) adds what the served items never hold (images, logprobs, tool results)."""
        for name in request.query_params:
            if name not in ("after", "limit", "order"):
                raise APIError(400, f"{name}: not supported by this server", param=name.removesuffix("[]"))
        _, context = await _stored(store, caller, response_id, "response_id")
        items = [listed_item(item, response_id, i) for i, item in enumerate(context)]
        if order == "desc":
            items.reverse()
        if after:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    @router.delete("/v1/responses/{response_id}", responses=NOT_FOUND)
    async def delete_response(response_id: str, caller: Caller) -> dict:
        if not await asyncio.to_thread(store.delete, caller.key_id, response_id):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return router


async def _earlier(store: ResponseStore, caller: Principal, previous_id: str | None) -> list[Item]:
    """The items a continuation follows: the previous response's context, then its output."""
    if previous_id is None:
        return []
    response, context = await _stored(store, caller, previous_id, "previous_response_id")
    return ITEMS.validate_python(context + response["output"])


async def _stored(store: ResponseStore, caller: Principal, response_id: str, param: str) -> tuple[dict, list[dict]]:
    found = await asyncio.to_thread(store.get, caller.key_id, response_id)
    if found is None:
        raise _not_found(response_id, param)
    return found


def _not_found(response_id: str, param: str) -> APIError:
    """Another key's response is as unknown as one never made: the same 404, nothing told about it."""
    return APIError(404, f"No response found with id {response_id!r}.", param=param, code="not_found")


async def _save(store: ResponseStore, caller: Principal, response: dict, context: list[Item]) -> None:
    items = [item.model_dump(exclude_none=True, by_alias=True) for item in context]
    try:
        await asyncio.to_thread(store.save, caller.key_id, response, items)
    except Exception as error:  # the response ran and is billed, but a client told "stored" must be able to get it
        raise APIError(500, f"The response ran but could not be stored ({error}); retry with store false.") from error
