"""`/dashboard`: a live page for operators, served by carpool itself (static files in this package, no build
step, nothing fetched from elsewhere).

The page and its script hold no data, so they load without a key (a browser cannot send a bearer key when it
navigates); the page asks for a key and sends it with every poll of `/dashboard/data`, which needs what the
usage report needs: an admin key on a server with a ledger (spend and budgets per key are there). A server
without a ledger (open, or `--api-key`) shows only what /metrics shows everyone, to any caller it lets in.
"""

from collections.abc import Callable
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, Response

from carpool.economics.contract import BATCHES_READ_ALL, USAGE_READ, Principal
from carpool.engine.async_engine import AsyncEngine
from carpool.server.auth import request_principal
from carpool.server.batch.service import BatchService
from carpool.server.dashboard.data import DashboardData
from carpool.server.errors import APIError, documented
from carpool.server.metrics import ServerMetrics

PAGE_PATHS = ("/dashboard", "/dashboard/dashboard.js")  # open: no data in them
RECENT_BATCHES = 8


def _static(name: str) -> str:
    return (resources.files(__package__) / "static" / name).read_text(encoding="utf-8")


def dashboard_router(
    engines: dict[str, AsyncEngine],
    metrics: ServerMetrics,
    started: float,
    batches: BatchService | None,
    ledger_panels: Callable[[], dict] | None,
    admin_only: bool,
) -> APIRouter:
    router = APIRouter()
    data = DashboardData(metrics.registry, list(engines), started)
    page, script = _static("index.html"), _static("dashboard.js")

    @router.get(PAGE_PATHS[0], include_in_schema=False)
    def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get(PAGE_PATHS[1], include_in_schema=False)
    def dashboard_script() -> Response:
        return Response(script, media_type="text/javascript")

    # A plain `def`: FastAPI runs it on its thread pool, so the ledger's report never stalls the event loop.
    @router.get("/dashboard/data", responses=documented(403))
    def dashboard_data(principal: Annotated[Principal, Depends(request_principal)]) -> dict:
        if admin_only and not principal.may(USAGE_READ):
            raise APIError(403, f"The dashboard needs a key with the {USAGE_READ} scope.", code="admin_key_required")
        for name, engine in engines.items():  # the gauges /metrics would set before rendering
            metrics.models[name].set_gauges(engine.snapshot())
        document = data.document()
        document["ready"] = all(engine.ready.is_set() for engine in engines.values())
        document["ledger"] = ledger_panels() if ledger_panels is not None else None
        document["batches"] = _batches(batches, principal) if batches is not None else None
        return document

    return router


def _batches(batches: BatchService, principal: Principal) -> list[dict]:
    """The newest batches the caller may see (everyone's with batches:read-all), with their progress."""
    rows, _ = batches.store.list_batches(
        principal.tenant or principal.key_id, principal.may(BATCHES_READ_ALL), None, RECENT_BATCHES
    )
    return [
        {
            "id": row["id"],
            "status": row["status"],
            "endpoint": row["endpoint"],
            "total": row["total"],
            "completed": row["completed"],
            "failed": row["failed"],
            "created_at": row["created_at"],
        }
        for row in rows
    ]
