"""`GET /v1/usage`: the usage report over HTTP, for keys with the usage:read scope only.

The server mounts `usage_router(gate, caller)` behind its own authentication: `caller` is the server's route
dependency that gives the request's Principal, and refusals are GateErrors, which the server answers with
OpenAI's error body like any other.
"""

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from carpool.economics.contract import USAGE_READ, GateError, Principal
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.reports import GROUP_BY, parse_time, report_document

# What parse_time takes, as /openapi.json documents it: unix seconds, or an ISO 8601 date or date-time.
Moment = Annotated[
    str | None,
    Query(
        description="unix seconds, or an ISO 8601 date or date-time (UTC unless it says otherwise)",
        json_schema_extra={
            "anyOf": [
                {"type": "string", "format": "date"},
                {"type": "string", "format": "date-time"},
                {"type": "string", "pattern": r"^-?[0-9]{1,12}(\.[0-9]+)?$"},
            ]
        },
    ),
]


def usage_router(gate: LedgerGate, caller: Callable[..., Principal]) -> APIRouter:
    router = APIRouter()

    # A plain `def`: FastAPI runs it on its thread pool, so the ledger query never stalls the event loop.
    @router.get("/v1/usage")
    def usage(
        principal: Annotated[Principal, Depends(caller)],
        start: Moment = None,
        end: Moment = None,
        group_by: Annotated[str, Query(json_schema_extra={"enum": list(GROUP_BY)})] = "tenant",
    ):
        _check_scope(principal)
        if group_by not in GROUP_BY:
            raise GateError(
                400,
                f"group_by must be one of {', '.join(GROUP_BY)}, got {group_by!r}",
                "invalid_value",
                param="group_by",
            )
        bounds = _bounds(start, end)
        rows = gate.usage(group_by, bounds["start"], bounds["end"])
        return report_document(rows, group_by, bounds["start"], bounds["end"])

    @router.get("/v1/usage/cascades")
    def cascade_usage(principal: Annotated[Principal, Depends(caller)], start: Moment = None, end: Moment = None):
        """Per model cascade: share answered by each step, cost, estimated saving (reports.cascade_summary)."""
        _check_scope(principal)
        bounds = _bounds(start, end)
        rows = gate.cascade_usage(bounds["start"], bounds["end"])
        return {"object": "list", "start": bounds["start"], "end": bounds["end"], "data": [r.as_dict() for r in rows]}

    return router


def _check_scope(principal: Principal) -> None:
    if not principal.may(USAGE_READ):
        raise GateError(403, f"The usage report needs a key with the {USAGE_READ} scope.", "admin_key_required")


def _bounds(start: str | None, end: str | None) -> dict[str, float | None]:
    bounds = {}
    for name, text in (("start", start), ("end", end)):
        try:
            bounds[name] = parse_time(text) if text is not None else None
        except ValueError as error:
            raise GateError(400, str(error), "invalid_value", param=name) from None
    return bounds
