"""The gate's first question, asked before a request body is even read: who is calling? (401 if nobody known.)

Only /health, /metrics and the dashboard's page (not its data) answer without a key. The API's schema and its
pages (/openapi.json, /docs, /redoc) need one whenever the gate does: they are open exactly when the API is.
"""

import asyncio

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.economics.contract import Gate, GateError, Principal
from carpool.server.errors import APIError, error_response

# The dashboard's page and script hold no data: its data endpoint needs a key like the rest.
OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard/dashboard.js"})


class Authenticate:
    """Puts the caller's Principal in `request.state.principal`; the open paths need no key."""

    def __init__(self, app: ASGIApp, gate: Gate):
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            key = bearer_key(dict(scope["headers"]))
            try:
                if getattr(self.gate, "admits_remotely", False):  # a database round trip: off the event loop
                    principal = await asyncio.to_thread(self.gate.authenticate, key)
                else:
                    principal = self.gate.authenticate(key)
            except GateError as error:
                return await error_response(APIError.from_gate_error(error))(scope, receive, send)
            scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def request_principal(request: Request) -> Principal:
    """The caller Authenticate found, as a route's dependency (`Depends(request_principal)`)."""
    return request.state.principal


def bearer_key(headers: dict[bytes, bytes]) -> str | None:
    """The key of `Authorization: Bearer`, else of `x-api-key` (what Anthropic's clients send): the same keys."""
    scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip() or None
