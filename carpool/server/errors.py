"""Every failure leaves as OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, so the SDKs
raise their usual exception classes. Validation failures are 400 naming the parameter (not FastAPI's 422), and
/openapi.json documents them so, with every other status a route can answer: its own (`responses=documented(...)`
on the route) and those of the layers around every route (401 from authentication, 413 from the body limit, 500).
A 405 names in `Allow` every method the path takes, not only those of the first route that matched it."""

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match

from carpool.economics.contract import GateError

log = logging.getLogger("carpool.server")

REQUEST_ID_HEADER = "x-request-id"

_TYPE_NAMES = {"str", "int", "float", "bool", "none"}
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    @classmethod
    def from_value_error(
        cls, error: ValueError, fields, renamed: dict[str, str] | None = None, code: str | None = None
    ) -> "APIError":
        """A 400 for an engine-side ValueError, whose message starts with the offending field's name (named as
        the request calls it: `renamed` maps engine names such as `prompt` to the API's, such as `messages`)."""
        message = str(error)
        match = re.match(r"[a-z_]+", message)
        param = match.group() if match else None
        param = (renamed or {}).get(param, param)
        return cls(400, message, param=param if param in fields else None, code=code)

    @classmethod
    def from_gate_error(cls, error: GateError) -> "APIError":
        return cls(error.status, error.message, param=error.param, code=error.code, retry_after=error.retry_after)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    # A message may quote the caller's input, which can hold a lone surrogate that no JSON encoder writes as UTF-8.
    message, param = (
        text if text is None else text.encode("utf-8", "backslashreplace").decode() for text in (message, param)
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(error.retry_after)))} if error.retry_after is not None else None
    return JSONResponse(error_body(error.status, error.message, error.param, error.code), error.status, headers)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = _most_telling(exc.errors())
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return error_response(APIError(400, f"The request body is not valid JSON: {first.get('msg')}"))
    if not loc:
        return error_response(APIError(400, f"The request body must be a JSON object: {first.get('msg')}"))
    if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
        path = f"{field_path(loc[:-1])}.{loc[-1]}" if len(loc) > 1 else str(loc[0])
        return error_response(APIError(400, f"Unrecognized request argument supplied: {path}", param=str(loc[0])))
    return error_response(APIError(400, f"{field_path(loc)}: {first.get('msg')}", param=str(loc[0])))


def _most_telling(errors: list[dict]) -> dict:
    """The error to report. A value that fits none of a field's types gets one error per type; a constraint the
    right type broke (`stop` with 5 strings: "at most 4 items") says more than "Input should be a valid string"."""
    first = errors[0]
    field = [part for part in first.get("loc", ()) if part != "body"][:1]
    for error in errors:
        same_field = [part for part in error.get("loc", ()) if part != "body"][:1] == field
        if same_field and not error.get("type", "").endswith("_type"):
            return error
    return first


def field_path(loc: list) -> str:
    """`messages[0].content` from pydantic's error location, less the union members it tried (`str`,
    `list[int]`, `TextPart`): this API's field names are all snake_case and none is a type's name."""
    path = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[a-z_]+", part) and part not in _TYPE_NAMES:
            path += f".{part}"
    return path


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    headers = exc.headers
    if exc.status_code == 405:  # Starlette's names the methods of one route; a path may have one route per method
        headers = (headers or {}) | {"Allow": ", ".join(_allowed_methods(request))}
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code, headers)


def _allowed_methods(request: Request) -> list[str]:
    """Asked of the router as a request of each method would be (its routes may be routers of routes)."""
    routes = request.app.router.routes
    return [
        method
        for method in _METHODS
        if any(route.matches(request.scope | {"method": method})[0] == Match.FULL for route in routes)
    ]


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    # Answered outside every middleware, so the request id is added here.
    request_id = request.scope.get("state", {}).get("request_id")
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return JSONResponse(error_body(500, "The server had an error while processing your request."), 500, headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, lambda request, exc: error_response(exc))
    app.add_exception_handler(GateError, lambda request, exc: error_response(APIError.from_gate_error(exc)))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    _document_validation_as_400(app)


STATUS_DESCRIPTIONS = {
    400: "Invalid request: the error's `param` names the field",
    401: "No API key, or one the server does not know",
    403: "The key may not do this (another tenant's, not an admin's, or a model or tier it is not allowed)",
    404: "No such model, or no such object visible to this key",
    409: "The object is in a state that does not allow this",
    413: "The request body is larger than the server accepts",
    429: "Over the key's rate limit or budget, or the tier's queue is full: retry after Retry-After seconds",
    499: "The client closed the connection before the response (nginx's status; nothing is sent)",
    500: "The server had an error while processing the request",
    503: "Not ready: the engine is warming up or stopped, or the ledger cannot record usage",
}


def documented(*statuses: int, error_schema: str = "Error") -> dict[int, dict]:
    """A route's `responses=`: its own error statuses, each with the error body (`error_schema`: a schema of the
    components, e.g. one an operation brings under EXTRA_COMPONENTS)."""
    content = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error_schema}"}}}}
    return {status: {"description": STATUS_DESCRIPTIONS[status]} | content for status in statuses}


# An operation's own schemas for the components (its body's nested models, its error shape), as its openapi_extra
# carries them: the hook below moves them into the components.
EXTRA_COMPONENTS = "x-carpool-components"


def body_schema(model: type[BaseModel]) -> dict:
    """The `openapi_extra=` of a route that reads its JSON body itself (to word its own 400s): the body's schema,
    its nested models among the components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.pop("$defs", {})
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    return {"requestBody": body, EXTRA_COMPONENTS: components}


_ERROR_CONTENT = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


# The paths that need no key (auth lets them through; the schema documents no 401 on them). The dashboard's page
# and script hold no data: its data endpoint needs a key like the rest.
OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard/dashboard.js"})


def _document_validation_as_400(app: FastAPI) -> None:
    """FastAPI documents a 422 on every route that validates input; this server answers those with a 400. Every
    route may also answer the statuses of the layers around it."""
    generate = app.openapi

    def openapi() -> dict:
        fresh = app.openapi_schema is None
        schema = generate()
        if fresh:
            extra: dict[str, dict] = {}
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    for name, component in operation.pop(EXTRA_COMPONENTS, {}).items():
                        if extra.setdefault(name, component) != component:
                            raise ValueError(f"two operations bring different schemas named {name!r}")
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {"description": STATUS_DESCRIPTIONS[400]} | _ERROR_CONTENT
                    around = (
                        [500]
                        + ([401] if path not in OPEN_PATHS else [])
                        + ([413] if "requestBody" in operation else [])
                    )
                    for status, response in documented(*around).items():
                        responses.setdefault(str(status), response)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            components["Error"] = _ERROR_SCHEMA
            for name, component in extra.items():
                if components.setdefault(name, component) != component:
                    raise ValueError(f"an operation's schema {name!r} is named as one of the API's own")
        return schema

    app.openapi = openapi
