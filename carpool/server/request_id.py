"""`x-request-id` on every response, as OpenAI sends it (the SDKs expose it as `response._request_id`): the
client's own id if it sent a sane one, so its logs and the server's meet, else a new `req_...`."""

import re
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.server.errors import REQUEST_ID_HEADER

# What a client may choose: enough for UUIDs and most tracing ids, nothing that could forge a header or a log line.
_SANE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
_HEADER = REQUEST_ID_HEADER.encode()


class RequestId:
    """Puts the id in `scope["state"]["request_id"]` and on the response. Add it outermost, so a 401 or 413
    from the other middleware carries one too."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(_HEADER, b"").decode("latin-1")
        request_id = sent if _SANE.fullmatch(sent) else "req_" + secrets.token_hex(16)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
