"""Anthropic's error shape on the Messages API's paths, `{"type": "error", "error": {"type", "message"}}`, with
the statuses the OpenAI routes use, and Anthropic's `request-id` header beside carpool's `x-request-id`.

The server raises one kind of error everywhere (carpool.server.errors: the gate's 401/403/429, the body limit's
413, validation's 400, the engine's 500) and renders it in OpenAI's shape; AnthropicErrors, a middleware around
them all, re-renders those answers on /v1/messages paths. So no check exists twice, and an error raised before a
route runs (a bad key, a body too large) has Anthropic's shape too.
"""

import json
import logging

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.server.errors import EXTRA_COMPONENTS, body_schema, documented

log = logging.getLogger("carpool.server")

PATH_PREFIX = "/v1/messages"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def openapi(*statuses: int, body: type[BaseModel] | None = None) -> dict:
    """A Messages API route's `responses` and `openapi_extra` keywords: its statuses in Anthropic's error shape,
    with what every route may answer (401, 500; with a body 400 and 413), and its body's schema."""
    around = {401, 500} | ({400, 413} if body else set())
    extra = body_schema(body) if body else {EXTRA_COMPONENTS: {}}
    extra[EXTRA_COMPONENTS]["AnthropicError"] = ERROR_SCHEMA
    responses = documented(*sorted({*statuses, *around}), error_schema="AnthropicError")
    return {"responses": responses, "openapi_extra": extra}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str) -> dict:
    # A message may quote the caller's input, which can hold a lone surrogate that no JSON encoder writes as UTF-8.
    message = message.encode("utf-8", "backslashreplace").decode()
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def from_openai(status: int, body: dict) -> dict:
    """carpool's OpenAI-shaped error body as Anthropic's."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return anthropic_error(status, message if isinstance(message, str) else f"Error {status}")


class AnthropicErrors:
    """On PATH_PREFIX paths: every JSON error answer re-rendered in Anthropic's shape, an exception that nothing
    answered as Anthropic's `api_error` 500, and a `request-id` header on every response."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH_PREFIX):
            return await self.app(scope, receive, send)
        request_id = scope.get("state", {}).get("request_id", "").encode("latin-1")
        held: Message | None = None  # an error's start, sent once its whole body is read and re-rendered
        body = b""
        started = False

        async def reshape(message: Message) -> None:
            nonlocal held, body, started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", []), (b"request-id", request_id)]
                message = {**message, "headers": headers}
                content_type = dict(headers).get(b"content-type", b"")
                if message["status"] >= 400 and content_type.startswith(b"application/json"):
                    held = message
                    return
                return await send(message)
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            try:
                reshaped = json.dumps(from_openai(held["status"], json.loads(body))).encode()
            except ValueError:
                reshaped = body
            headers = [(name, value) for name, value in held["headers"] if name.lower() != b"content-length"]
            await send({**held, "headers": [*headers, (b"content-length", str(len(reshaped)).encode())]})
            await send({"type": "http.response.body", "body": reshaped})

        try:
            await self.app(scope, receive, reshape)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope["path"])
            reshaped = json.dumps(anthropic_error(500, "The server had an error while processing your request."))
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(reshaped)).encode()),
                (b"request-id", request_id),
            ]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": reshaped.encode()})
