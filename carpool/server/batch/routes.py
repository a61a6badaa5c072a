"""OpenAI's Files and Batches endpoints, as the official SDKs call them.

Callers see only their own files and batches (those of their tenant, or of their key when it has no tenant). A
key with `files:read-all` also reads everyone's files (their prompts and outputs: each read of another's file's
content is audited by the gate first), one with `batches:read-all` everyone's batch objects; neither may change
or use another's objects (delete, cancel, a batch from another's input). Someone else's object answers 404, as
if it did not exist.
"""

import asyncio
import time
from pathlib import PurePosixPath
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from carpool.economics.contract import BATCHES_READ_ALL, FILES_READ_ALL, Gate, Principal
from carpool.engine.tiers import BATCH_TIER
from carpool.server.batch.limits import COMPLETION_WINDOWS, ENDPOINTS, BatchLimits
from carpool.server.batch.objects import batch_object, file_object, list_object
from carpool.server.batch.runner import BatchRunner
from carpool.server.batch.store import BatchStore, FileTooLarge
from carpool.server.errors import APIError, documented

UPLOAD_PURPOSES = ("batch",)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    # Checked by the route, with its own messages; /openapi.json says what it takes.
    input_file_id: str
    endpoint: str = Field(json_schema_extra={"enum": list(ENDPOINTS)})
    completion_window: str = Field(json_schema_extra={"enum": list(COMPLETION_WINDOWS)})
    metadata: dict[str, str] | None = Field(
        None,
        json_schema_extra={
            "maxProperties": MAX_METADATA_PAIRS,
            "propertyNames": {"maxLength": MAX_METADATA_KEY},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        },
    )


def create_batch_router(store: BatchStore, runner: BatchRunner, gate: Gate, limits: BatchLimits) -> APIRouter:
    router = APIRouter()

    # Files -----------------------------------------------------------------------------------------------

    @router.post("/v1/files")
    async def upload_file(
        request: Request,
        file: Annotated[UploadFile, File()],
        purpose: Annotated[str, Form(json_schema_extra={"enum": list(UPLOAD_PURPOSES)})],
    ):
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(
                400,
                f"purpose: this server takes uploads for {UPLOAD_PURPOSES}, got {purpose!r}",
                param="purpose",
                code="invalid_value",
            )
        owner = owner_of(_caller(request))
        try:
            row = await asyncio.to_thread(
                store.save_file,
                owner,
                upload_name(file.filename),
                purpose,
                file.file,
                limits.max_file_bytes,
                int(time.time()),
            )
        except FileTooLarge as error:
            raise APIError(400, f"file: {error}", param="file", code="file_too_large") from None
        return file_object(row)

    @router.get("/v1/files")
    def list_files(
        request: Request,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        order: Literal["asc", "desc"] = "desc",
        purpose: str | None = None,
    ):
        principal = _caller(request)
        rows, has_more = store.list_files(
            owner_of(principal), principal.may(FILES_READ_ALL), purpose, after, limit, newest_first=order == "desc"
        )
        return list_object([file_object(row) for row in rows], has_more)

    @router.get("/v1/files/{file_id}", responses=documented(404))
    def get_file(request: Request, file_id: str):
        return file_object(_visible_file(request, file_id, FILES_READ_ALL))

    @router.get(
        "/v1/files/{file_id}/content",
        response_class=FileResponse,
        responses={200: {"content": {"application/octet-stream": {}}}} | documented(404),
    )
    def file_content(request: Request, file_id: str):
        principal = _caller(request)
        row = _visible_file(request, file_id, FILES_READ_ALL)
        if row["owner"] != owner_of(principal):  # another tenant's prompts: on the record before they are read
            gate.audit(principal, "files.content", row["id"], row["owner"])
        return FileResponse(store.file_path(row["id"]), media_type="application/octet-stream", filename=row["filename"])

    @router.delete("/v1/files/{file_id}", responses=documented(404, 409))
    def delete_file(request: Request, file_id: str):
        row = _visible_file(request, file_id, None)
        if store.file_in_use(row["id"]):
            raise APIError(
                409,
                f"File {file_id!r} is the input of a batch that has not finished; cancel it first.",
                param="file_id",
                code="file_in_use",
            )
        store.delete_file(row["id"])
        return {"id": row["id"], "object": "file", "deleted": True}

    def _visible_file(request: Request, file_id: str, read_all: str | None) -> dict:
        row = store.get_file(file_id)
        if row is None or not may_see(_caller(request), row, read_all):
            raise APIError(404, f"No such file: {file_id!r}", param="file_id", code="not_found")
        return row

    # Batches ---------------------------------------------------------------------------------------------

    # These two touch the runner, which lives on the event loop: they run there, their store calls in threads.
    @router.post("/v1/batches", responses=documented(403, 404, 429, 503))
    async def create_batch(request: Request, body: BatchCreateRequest):
        principal = _caller(request)
        if body.endpoint not in ENDPOINTS:
            raise APIError(
                400, f"endpoint: batches run {ENDPOINTS}, got {body.endpoint!r}", param="endpoint", code="invalid_value"
            )
        if body.completion_window not in COMPLETION_WINDOWS:
            raise APIError(
                400,
                f"completion_window: must be one of {tuple(COMPLETION_WINDOWS)}, got {body.completion_window!r}",
                param="completion_window",
                code="invalid_value",
            )
        _check_metadata(body.metadata)
        input_file = await asyncio.to_thread(store.get_file, body.input_file_id)
        if input_file is None or not may_see(principal, input_file, None):
            raise APIError(404, f"No such file: {body.input_file_id!r}", param="input_file_id", code="not_found")
        if input_file["purpose"] != "batch":
            raise APIError(
                400,
                f"input_file_id: {body.input_file_id!r} was uploaded for {input_file['purpose']!r}, not 'batch'",
                param="input_file_id",
                code="invalid_value",
            )
        gate.admit(principal, BATCH_TIER, 0)  # may this key use the batch tier, and has it budget left?
        now = int(time.time())
        row = await asyncio.to_thread(
            store.create_batch,
            owner=owner_of(principal),
            key_id=principal.key_id,
            tenant=principal.tenant,
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            metadata=body.metadata,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[body.completion_window],
        )
        runner.submit(row["id"])
        return batch_object(row)

    @router.get("/v1/batches")
    def list_batches(request: Request, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20):
        principal = _caller(request)
        rows, has_more = store.list_batches(owner_of(principal), principal.may(BATCHES_READ_ALL), after, limit)
        return list_object([batch_object(row) for row in rows], has_more)

    @router.get("/v1/batches/{batch_id}", responses=documented(404))
    def get_batch(request: Request, batch_id: str):
        return batch_object(_visible_batch(request, batch_id, BATCHES_READ_ALL))

    @router.post("/v1/batches/{batch_id}/cancel", responses=documented(404, 409))
    async def cancel_batch(request: Request, batch_id: str):
        row = await asyncio.to_thread(_visible_batch, request, batch_id, None)
        cancelling = ("validating", "in_progress")
        if await asyncio.to_thread(store.transition, row["id"], "cancelling", int(time.time()), cancelling):
            runner.cancel(row["id"])
            return batch_object(await asyncio.to_thread(store.get_batch, row["id"]))
        row = await asyncio.to_thread(store.get_batch, row["id"])
        if row["status"] in ("cancelling", "cancelled"):
            return batch_object(row)
        raise APIError(
            409,
            f"Batch {batch_id!r} is {row['status']} and can no longer be cancelled.",
            param="batch_id",
            code="batch_not_cancellable",
        )

    def _visible_batch(request: Request, batch_id: str, read_all: str | None) -> dict:
        row = store.get_batch(batch_id)
        if row is None or not may_see(_caller(request), row, read_all):
            raise APIError(404, f"No such batch: {batch_id!r}", param="batch_id", code="not_found")
        return row

    return router


def upload_name(filename: str | None) -> str:
    """An upload's name without its folders (`../../x.jsonl` is `x.jsonl`, Windows' separators too): the name is
    echoed in the file object and in Content-Disposition, where a path has no business."""
    name = PurePosixPath((filename or "").replace("\\", "/")).name
    return name if name not in ("", ".", "..") else "upload.jsonl"


def _caller(request: Request) -> Principal:
    return request.state.principal


def owner_of(principal: Principal) -> str | None:
    return principal.tenant or principal.key_id


def may_see(principal: Principal, row: dict, read_all: str | None) -> bool:
    """Whether the caller owns `row`, or reads it by the scope `read_all` (None: only its owner may)."""
    return row["owner"] == owner_of(principal) or (read_all is not None and principal.may(read_all))


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"metadata: at most {MAX_METADATA_PAIRS} pairs", param="metadata", code="invalid_value")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(
                400,
                f"metadata: keys are at most {MAX_METADATA_KEY} characters and values at most {MAX_METADATA_VALUE}",
                param="metadata",
                code="invalid_value",
            )
