"""Anthropic's Message Batches on carpool's durable batch runner (carpool.server.batch).

A batch's requests are written as an input file of the runner's own lines (`{"custom_id", "method": "POST",
"url": "/v1/messages", "body": params}`) and run like any batch: at the batch tier's price, one result stored
per line as it finishes, resumed after a kill -9 from the lines without one, each custom_id answered exactly once.
Every request's params are checked when the batch is created (a 400 naming `requests[i].params.<field>`), so a
batch never fails as a whole; what only the model can say (a prompt too long, a tool the template cannot render)
is that request's `errored` result. Results are the runner's records, rendered as Anthropic's JSONL on the way
out. Ids are the store's (`batch_<hex>` shown as `msgbatch_<hex>`); a key sees only its own batches (its tenant's,
as the OpenAI Batch API's rules say), and another's answers 404 as if it did not exist. Message batches are
also the store's batches: the OpenAI routes list them (endpoint `/v1/messages`) and their files.
"""

import asyncio
import io
import json
import re
import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from carpool.economics.contract import BATCHES_READ_ALL, Gate
from carpool.engine.tiers import BATCH_TIER
from carpool.server.anthropic.caching import marks
from carpool.server.anthropic.convert import check_conversation
from carpool.server.anthropic.errors import from_openai, openapi
from carpool.server.anthropic.protocol import CreateMessageBatch, MessagesRequest, json_body, parse
from carpool.server.batch.limits import COMPLETION_WINDOWS
from carpool.server.batch.routes import may_see, owner_of
from carpool.server.batch.service import BatchService
from carpool.server.batch.validation import iter_lines
from carpool.server.errors import APIError

ENDPOINT = "/v1/messages"
ID_PREFIX, STORE_PREFIX = "msgbatch_", "batch_"
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The runner's unanswered-line codes: a request that never ran because its batch was cancelled or expired.
_NEVER_RAN = {"batch_cancelled": "canceled", "batch_expired": "expired"}
_ENDED = ("completed", "cancelled", "expired", "failed")


def create_message_batches_router(batches: BatchService, gate: Gate) -> APIRouter:
    store, runner, limits = batches.store, batches.runner, batches.limits
    router = APIRouter()

    @router.post("/v1/messages/batches", **openapi(403, 429, 503, body=CreateMessageBatch))
    async def create(request: Request) -> dict:
        principal = request.state.principal
        lines = await asyncio.to_thread(_input_lines, await json_body(request), limits.max_requests)
        gate.admit(principal, BATCH_TIER, 0)  # may this key use the batch tier, and has it budget left?
        now = int(time.time())
        saved = await asyncio.to_thread(
            store.save_file,
            owner_of(principal),
            "message_batch_requests.jsonl",
            "batch",
            io.BytesIO(lines),
            limits.max_file_bytes,
            now,
        )
        row = store.create_batch(
            owner=owner_of(principal),
            key_id=principal.key_id,
            tenant=principal.tenant,
            endpoint=ENDPOINT,
            input_file_id=saved["id"],
            completion_window="24h",
            metadata=None,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS["24h"],
        )
        runner.submit(row["id"])
        return _batch_object(row, request)

    @router.get("/v1/messages/batches", **openapi(400))
    def list_batches(
        request: Request,
        before_id: str | None = None,
        after_id: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    ) -> dict:
        principal = request.state.principal
        before_id, after_id = before_id or None, after_id or None  # `?before_id=`: no cursor, as an absent one
        if before_id is not None and after_id is not None:
            raise APIError(400, "before_id: give at most one of before_id and after_id", param="before_id")
        owner, everyone = owner_of(principal), principal.may(BATCHES_READ_ALL)
        if before_id is not None:  # the batches created after it, nearest first, shown newest first
            rows, has_more = store.list_batches(owner, everyone, _store_id(before_id), limit, ENDPOINT, False)
            rows.reverse()
        else:
            cursor = None if after_id is None else _store_id(after_id)
            rows, has_more = store.list_batches(owner, everyone, cursor, limit, ENDPOINT)
        data = [_batch_object(row, request) for row in rows]
        return {
            "data": data,
            "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    @router.get("/v1/messages/batches/{batch_id}", **openapi(404))
    def retrieve(request: Request, batch_id: str) -> dict:
        return _batch_object(_visible(request, batch_id, BATCHES_READ_ALL), request)

    @router.post("/v1/messages/batches/{batch_id}/cancel", **openapi(404))
    async def cancel(request: Request, batch_id: str) -> dict:
        row = _visible(request, batch_id)
        if store.transition(row["id"], "cancelling", int(time.time()), ("validating", "in_progress")):
            runner.cancel(row["id"])
        return _batch_object(store.get_batch(row["id"]), request)

    @router.delete("/v1/messages/batches/{batch_id}", **openapi(404, 409))
    def delete(request: Request, batch_id: str) -> dict:
        row = _visible(request, batch_id)
        if row["status"] not in _ENDED:
            raise APIError(
                409, f"Message batch {batch_id!r} is still processing; cancel it and let it end first.", "batch_id"
            )
        store.delete_batch(row["id"])
        return {"id": batch_id, "type": "message_batch_deleted"}

    results = openapi(404)
    results["responses"][200] = {"description": "One JSON line per request", "content": {"application/binary": {}}}

    @router.get("/v1/messages/batches/{batch_id}/results", **results)
    def message_batch_results(request: Request, batch_id: str) -> StreamingResponse:
        row = _visible(request, batch_id)
        if row["status"] not in _ENDED:
            raise APIError(404, f"Message batch {batch_id!r} has not ended: its results come when it does.")
        if _cancelled_before_running(row):
            lines = (_canceled_line(raw) for _, raw in iter_lines(store.file_path(row["input_file_id"])))
        else:
            files = [store.file_path(row[name]) for name in ("output_file_id", "error_file_id") if row[name]]
            lines = (_result_line(raw) for path in files for _, raw in iter_lines(path))
        # A generator of plain lines: Starlette reads it on a worker thread, a page of the file at a time.
        return StreamingResponse(lines, media_type="application/binary")

    def _visible(request: Request, batch_id: str, read_all: str | None = None) -> dict:
        """The caller's own batch, or with `read_all` (retrieve: the batches:read-all scope) any tenant's; cancel,
        delete and results (the tenant's outputs) stay the owner's."""
        row = store.get_batch(_store_id(batch_id)) if batch_id.startswith(ID_PREFIX) else None
        if row is None or row["endpoint"] != ENDPOINT or not may_see(request.state.principal, row, read_all):
            raise APIError(404, f"No such message batch: {batch_id!r}", param="batch_id")
        return row

    def _batch_object(row: dict, request: Request) -> dict:
        ended = row["status"] in _ENDED
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        if row["status"] == "validating":  # a moment after creation: the runner has not counted the lines yet
            counts["processing"] = sum(1 for _ in iter_lines(store.file_path(row["input_file_id"])))
        elif not ended:  # as Anthropic counts: every request is processing until the whole batch ends
            counts["processing"] = row["total"]
        elif _cancelled_before_running(row):
            counts["canceled"] = sum(1 for _ in iter_lines(store.file_path(row["input_file_id"])))
        else:
            counts["succeeded"] = row["completed"]
            if row["error_file_id"]:
                for _, raw in iter_lines(store.file_path(row["error_file_id"])):
                    counts[_result_type(json.loads(raw))] += 1
        ended_at = next((row[f] for f in ("completed_at", "cancelled_at", "expired_at", "failed_at") if row[f]), None)
        batch_id = ID_PREFIX + row["id"].removeprefix(STORE_PREFIX)
        return {
            "id": batch_id,
            "type": "message_batch",
            "processing_status": "ended" if ended else "canceling" if row["status"] == "cancelling" else "in_progress",
            "request_counts": counts,
            "created_at": _rfc3339(row["created_at"]),
            "expires_at": _rfc3339(row["expires_at"]),
            "ended_at": _rfc3339(ended_at),
            "cancel_initiated_at": _rfc3339(row["cancelling_at"]),
            "archived_at": None,
            "results_url": str(request.url_for("message_batch_results", batch_id=batch_id)) if ended else None,
        }

    return router


def _input_lines(body, max_requests: int) -> bytes:
    """The runner's input file for a create body, each request checked (400 naming `requests[i].params...`)."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object with `requests`.")
    unknown = sorted(set(body) - {"requests"})
    if unknown:
        raise APIError(400, f"{unknown[0]}: unknown field", param=unknown[0])
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise APIError(400, "requests: must be a non-empty list of {custom_id, params}", param="requests")
    if len(requests) > max_requests:
        raise APIError(400, f"requests: at most {max_requests} requests in a batch, got {len(requests)}", "requests")
    seen: set[str] = set()
    lines = []
    for i, item in enumerate(requests):
        where = f"requests[{i}]"
        if not isinstance(item, dict) or set(item) != {"custom_id", "params"}:
            raise APIError(400, f"{where}: must be an object of exactly custom_id and params", param="requests")
        custom_id = item["custom_id"]
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise APIError(400, f"{where}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$", param="requests")
        if custom_id in seen:
            raise APIError(400, f"{where}.custom_id: {custom_id!r} is used by an earlier request", param="requests")
        seen.add(custom_id)
        params = parse(MessagesRequest, item["params"], f"{where}.params.")
        try:
            if params.stream:
                raise APIError(400, "stream: a batch request is answered whole, not streamed")
            check_conversation(params)
            marks(params)
        except APIError as error:
            raise APIError(400, f"{where}.params.{error.message}", param="requests") from None
        line = {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": item["params"]}
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
    return "".join(lines).encode()


def _cancelled_before_running(row: dict) -> bool:
    """Cancelled before its lines were even checked: the runner answered none of them (an OpenAI batch then has
    no files), but each of a message batch's requests is a result, `canceled`."""
    return row["status"] == "cancelled" and row["in_progress_at"] is None


def _canceled_line(raw: bytes) -> str:
    return json.dumps({"custom_id": json.loads(raw)["custom_id"], "result": {"type": "canceled"}}) + "\n"


def _result_type(record: dict) -> str:
    if record["response"] is None:
        return _NEVER_RAN.get((record["error"] or {}).get("code"), "errored")
    return "succeeded" if record["response"]["status_code"] == 200 else "errored"


def _result_line(raw: bytes) -> str:
    """A runner's record (OpenAI's batch output line) as Anthropic's result line."""
    record = json.loads(raw)
    kind = _result_type(record)
    result: dict = {"type": kind}
    if kind == "succeeded":
        result["message"] = record["response"]["body"]
    elif kind == "errored":
        response = record["response"]
        if response is None:
            result["error"] = from_openai(500, {"error": record["error"]})
        else:
            result["error"] = from_openai(response["status_code"], response["body"])
    return json.dumps({"custom_id": record["custom_id"], "result": result}, ensure_ascii=False) + "\n"


def _store_id(batch_id: str) -> str:
    return STORE_PREFIX + batch_id.removeprefix(ID_PREFIX)


def _rfc3339(timestamp: int | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")
