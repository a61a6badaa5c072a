"""The OpenAI-compatible HTTP server: `create_app(engines, gate)` gives the ASGI app for one or more models."""

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from carpool.economics.contract import Gate, GateError, Principal
from carpool.engine.async_engine import AsyncEngine
from carpool.server import limits
from carpool.server.admission import TierQueues, register_queue_metrics
from carpool.server.anthropic.errors import AnthropicErrors
from carpool.server.anthropic.routes import anthropic_routers
from carpool.server.auth import Authenticate, request_principal
from carpool.server.batch.service import BatchService
from carpool.server.body_limit import BodyLimit
from carpool.server.cascade.config import Cascade
from carpool.server.cascade.runner import CascadeServing
from carpool.server.compression import CompressionService
from carpool.server.dashboard import dashboard_router
from carpool.server.disconnect import CLIENT_CLOSED_REQUEST, disconnected, finished_before_disconnect
from carpool.server.errors import APIError, documented, error_body, install_error_handlers
from carpool.server.generation import Backends, Generation, GenerationFailed
from carpool.server.metrics import ServerMetrics
from carpool.server.open_gate import OpenGate
from carpool.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompressRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from carpool.server.request_id import RequestId
from carpool.server.responses import ChatFormat, CompletionFormat
from carpool.server.responses_api.routes import create_responses_router
from carpool.server.responses_api.store import ResponseStore
from carpool.server.serving import ClientLeft, Serving

Caller = Annotated[Principal, Depends(request_principal)]


def create_app(
    engines: AsyncEngine | dict[str, AsyncEngine],
    gate: Gate | None = None,
    model_name: str = "carpool",
    max_queued_per_tier: int = limits.MAX_QUEUED_PER_TIER,
    max_body_bytes: int = limits.MAX_BODY_BYTES,
    batch_dir: str | None = None,
    batch_db: str | None = None,
    ledger_panels: Callable[[], dict] | None = None,
    cascades: dict[str, Cascade] | None = None,
    compression_model: str | None = None,
) -> FastAPI:
    """`engines`: one engine, served as `model_name`, or {served name: engine} for several models, each with its
    own tier queues (a flood on one model does not 429 another). `ledger_panels`: the ledger's part of
    /dashboard (carpool.economics.dashboard), which then needs an admin key. `cascades`: {name: Cascade} that
    clients may pass as `model` (carpool.server.cascade). `compression_model`: the served model that scores
    prompt compression (default: the smallest served; carpool.server.compression)."""
    engines = {model_name: engines} if isinstance(engines, AsyncEngine) else engines
    gate = gate or OpenGate()
    metrics = ServerMetrics(list(engines))
    backends = []
    for name, engine in engines.items():
        engine.add_step_listener(metrics.models[name].on_step)
        backends.append(Backends(engine, gate, metrics.models[name], TierQueues(max_queued_per_tier), name))
    serving = Serving(backends)
    cascade_serving = CascadeServing(serving, cascades or {})
    compression = CompressionService(serving, gate, compression_model)
    register_queue_metrics(metrics.registry, {backend.model_name: backend.queues for backend in backends})
    # The Batch API, if given a home; `batch_db`: the PostgreSQL URL replicas share its metadata in.
    batches = BatchService(serving, gate, batch_dir, db=batch_db, cascades=cascade_serving) if batch_dir else None
    responses = ResponseStore(batch_dir, db=batch_db)  # stored where the batches are (in memory without a home)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for engine in engines.values():
            engine.start()
        if batches:
            await batches.start()
        yield
        if batches:
            await batches.stop()
        responses.close()
        for engine in engines.values():
            engine.stop()

    app = FastAPI(title="carpool", summary="OpenAI-compatible LLM serving", lifespan=lifespan)
    install_error_handlers(app)
    # A batch input file may be far larger than any single request (multipart overhead allowed for).
    uploads = {"/v1/files": batches.limits.max_file_bytes + 2**20} if batches else {}
    if batches:  # a Message Batches body holds its requests inline, as large as an input file
        uploads["/v1/messages/batches"] = batches.limits.max_file_bytes
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, path_limits=uploads)
    app.add_middleware(Authenticate, gate=gate)  # before the body limit: nobody unknown gets a body read
    app.add_middleware(AnthropicErrors)  # Anthropic's error shape on /v1/messages, whoever refused the request
    app.add_middleware(RequestId)  # outermost: every response carries x-request-id, a 401 or 413 too
    if batches:
        app.include_router(batches.router)
    for router in anthropic_routers(serving, batches, gate):
        app.include_router(router)
    app.include_router(create_responses_router(serving, responses))
    # Admin-only whenever keys come from a key store (which has admins), not only when the ledger panels are
    # shown: a later panel must not reach tenants because a caller left `ledger_panels` out.
    app.include_router(
        dashboard_router(
            engines, metrics, time.time(), batches, ledger_panels, admin_only=not isinstance(gate, OpenGate)
        )
    )

    # What the gate (403, 429, 503), the model lookup (404) and a client leaving early (499) may answer.
    generating = documented(403, 404, 429, 499, 503)

    async def generate(body: ChatCompletionRequest | CompletionRequest, request: Request, caller: Caller, start):
        """The generating routes' one path: compression, a cascade or the model (`start`: the serving's start of
        the body's kind), then the response, whole or streamed."""
        body, compressed = await compression.apply(body, caller, request.state.request_id)
        if body.model in cascade_serving:
            return await _respond(
                request,
                *await cascade_serving.answer(body, caller, request.state.request_id),
                body.stream,
                body.stream_options,
            )
        await serving.precompile(body)
        try:
            started = await serving.started(
                start, body, caller, request.state.request_id, lambda: disconnected(request)
            )
        except ClientLeft:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return await _respond(
            request, *compression.started(started, compressed), None, body.stream, body.stream_options
        )

    @app.post("/v1/chat/completions", response_model=None, responses=generating)
    async def chat_completions(body: ChatCompletionRequest, request: Request, caller: Caller):
        return await generate(body, request, caller, serving.start_chat)

    @app.post("/v1/completions", response_model=None, responses=generating)
    async def completions(body: CompletionRequest, request: Request, caller: Caller):
        return await generate(body, request, caller, serving.start_completion)

    @app.post("/v1/compress", responses=documented(403, 404, 429, 503))
    async def compress(body: CompressRequest, request: Request, caller: Caller) -> dict:
        return await compression.compress_body(body, caller, request.state.request_id)

    @app.get("/v1/models")
    def list_models(caller: Caller) -> dict:
        return {
            "object": "list",
            "data": [_model_card(name, started, engine) for name, engine in engines.items()]
            + cascade_serving.cards(started),
        }

    @app.get(
        "/v1/models/{model:path}", responses=documented(404)
    )  # served names may hold a slash (`Qwen/Qwen2.5-Coder-0.5B`)
    def get_model(model: str, caller: Caller) -> dict:
        if model in cascade_serving:
            return cascade_serving.card(model, started)
        serving.model(model)
        return _model_card(model, started, engines[model])

    @app.post("/tokenize", responses=documented(404))
    def tokenize(body: TokenizeRequest, caller: Caller) -> dict:
        return serving.tokenize(body)

    @app.post("/detokenize", responses=documented(404))
    def detokenize(body: DetokenizeRequest, caller: Caller) -> dict:
        return serving.detokenize(body)

    @app.get("/health", responses=documented(503))
    def health() -> Response:
        """Ok while every model's engine runs, warmed up, and the gate works (its ledger can write). A model whose
        engine failed is named; while others still serve, the server is up but `degraded` (200), not down."""
        stopped = {name: repr(engine.error) for name, engine in engines.items() if engine.error is not None}
        if len(stopped) == len(engines):
            failed = "; ".join(f"{name!r}: {error}" for name, error in stopped.items())
            return JSONResponse(error_body(503, f"The engine stopped: {failed}"), 503)
        if warming := [name for name, engine in engines.items() if not engine.ready.is_set()]:
            return JSONResponse({"status": "warming", "models": warming}, 503)
        if (problem := gate.health()) is not None:
            return JSONResponse(error_body(503, f"Billable requests are refused: {problem}"), 503)
        if stopped:
            return JSONResponse({"status": "degraded", "failed": stopped})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus_metrics() -> Response:
        snapshots = {name: engine.snapshot() for name, engine in engines.items()}
        return Response(metrics.render(snapshots), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    return app


def _model_card(model_name: str, created: int, engine: AsyncEngine) -> dict:
    return {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "carpool",
        "max_model_len": engine.max_model_len,
    }


async def _respond(
    request: Request,
    gen: Generation,
    fmt: ChatFormat | CompletionFormat,
    headers: dict | None,
    stream: bool | None,
    stream_options,
) -> Response:
    if stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        # The background task covers a stream that never started; otherwise the stream cancels on its way out.
        return StreamingResponse(
            _events(gen, fmt, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"} | (headers or {}),
            background=BackgroundTask(gen.cancel),
        )
    if not await finished_before_disconnect(request, gen):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        await gen.wait()
    except GenerationFailed as error:
        raise APIError(500, f"The engine failed while generating: {error}") from error
    return JSONResponse(fmt.response(gen), headers=headers)


async def _events(gen: Generation, fmt: ChatFormat | CompletionFormat, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events. Starlette cancels this when the client disconnects, which aborts the engine requests."""
    try:
        async for choice, output in gen.stream():
            chunk = fmt.chunk(gen, choice, output)
            if chunk is not None:
                yield _event(chunk)
        if include_usage:
            yield _event(fmt.usage_chunk(gen))
    except GenerationFailed as error:
        yield _event(error_body(500, f"The engine failed while generating: {error}"))
    except GateError as error:  # the usage could not be made durable: the stream must not end as a success
        yield _event(error_body(error.status, error.message, code=error.code))
    finally:
        gen.cancel()
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
