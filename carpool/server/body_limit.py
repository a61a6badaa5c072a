"""Refuse request bodies over a size limit with 413, before they are buffered whole into memory."""

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.server.errors import error_body


class BodyLimit:
    """`max_bytes` for every path except those in `path_limits` (file uploads are allowed to be larger)."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None):
        self.app, self.default_max_bytes, self.path_limits = app, max_bytes, path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.path_limits.get(scope["path"], self.default_max_bytes)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:
            return await self._refuse(send, max_bytes)
        received = 0

        async def counting_receive():
            # Chunked bodies declare no length: count as they arrive. FastAPI re-raises an HTTPException met
            # while reading the body, and the error handlers turn it into the OpenAI error body.
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise HTTPException(413, self._message(max_bytes))
            return message

        await self.app(scope, counting_receive, send)

    @staticmethod
    def _message(max_bytes: int) -> str:
        return f"The request body is larger than the limit of {max_bytes} bytes."

    async def _refuse(self, send: Send, max_bytes: int) -> None:
        body = json.dumps(error_body(413, self._message(max_bytes))).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
