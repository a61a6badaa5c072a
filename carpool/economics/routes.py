"""`GET /v1/usage`: the usage report over HTTP, for admin keys only. The server mounts `usage_router(gate)`."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from carpool.economics.gate import LedgerGate
from carpool.economics.reports import GROUP_BY, parse_time, report_document
from carpool.server.gate import GateError


def usage_router(gate: LedgerGate) -> APIRouter:
    router = APIRouter()

    # A plain `def`: FastAPI runs it on its thread pool, so the ledger query never stalls the event loop.
    @router.get("/v1/usage")
    def usage(request: Request, start: str | None = None, end: str | None = None, group_by: str = "tenant"):
        try:
            principal = gate.authenticate(_bearer_token(request))
        except GateError as error:
            return _error(error.status, error.message, "invalid_request_error", error.code)
        if not principal.is_admin:
            return _error(403, "The usage report needs an admin key.", "permission_error", "admin_key_required")
        if group_by not in GROUP_BY:
            message = f"group_by must be one of {', '.join(GROUP_BY)}, got {group_by!r}"
            return _error(400, message, "invalid_request_error", "invalid_value", param="group_by")
        bounds = {}
        for name, text in (("start", start), ("end", end)):
            try:
                bounds[name] = parse_time(text) if text is not None else None
            except ValueError as error:
                return _error(400, str(error), "invalid_request_error", "invalid_value", param=name)
        rows = gate.usage(group_by, bounds["start"], bounds["end"])
        return report_document(rows, group_by, bounds["start"], bounds["end"])

    return router


def _bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _error(status: int, message: str, kind: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)
