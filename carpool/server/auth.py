"""The gate's first question, asked before a request body is even read: who is calling? (401 if nobody known.)

Only /health, /metrics and the dashboard's page (not its data) answer without a key. The API's schema and its
pages (/openapi.json, /docs, /redoc) need one whenever the gate does: they are open exactly when the API is.

A request carries exactly one credential: `Authorization: Bearer KEY`, or `x-api-key: KEY` (what Anthropic's SDKs
send), or both with the same key. Two Authorization headers, or an x-api-key that differs from the bearer key,
are a 400: which of them counted would otherwise depend on header order, and a proxy that adds its own header
could make a request pass as another key.
"""

import asyncio

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.economics.contract import Gate, GateError, Principal
from carpool.server.errors import OPEN_PATHS, APIError, error_response


class Authenticate:
    """Puts the caller's Principal in `request.state.principal`; the open paths need no key."""

    def __init__(self, app: ASGIApp, gate: Gate):
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            try:
                key = request_key(scope["headers"])
            except APIError as error:
                return await error_response(error)(scope, receive, send)
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


def request_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's one API key (None: it sent none, or not as a bearer key); APIError 400 if it sent several."""
    authorizations = [value for name, value in headers if name.lower() == b"authorization"]
    api_keys = [value.decode("latin-1").strip() for name, value in headers if name.lower() == b"x-api-key"]
    if len(authorizations) > 1 or len(api_keys) > 1:
        header = "Authorization" if len(authorizations) > 1 else "x-api-key"
        raise APIError(
            400,
            f"{header}: send exactly one credential; this request has several {header} headers.",
            code="multiple_credentials",
        )
    keys = {bearer_key(value) for value in authorizations} | {key or None for key in api_keys}
    if len(keys) > 1:
        raise APIError(
            400,
            "Authorization: send exactly one credential; this request's x-api-key differs from its bearer key.",
            code="multiple_credentials",
        )
    return next(iter(keys), None)


def bearer_key(authorization: bytes) -> str | None:
    scheme, _, key = authorization.decode("latin-1").partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None
