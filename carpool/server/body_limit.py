"""Refuse request bodies over a size limit with 413, before they are buffered whole into memory."""

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.server.errors import error_body


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        received = 0

        async def counting_receive():
            # Chunked bodies declare no length: count as they arrive. FastAPI re-raises an HTTPException met
            # while reading the body, and the error handlers turn it into the OpenAI error body.
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"The request body is larger than the limit of {self.max_bytes} bytes."

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(error_body(413, self._message())).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
