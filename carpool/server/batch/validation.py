"""Check a whole input file before any of it runs, so a batch either starts clean or fails naming its bad lines.

A line is `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {...}}`; the body must pass
the same checks as a live request to that endpoint. Blank lines are skipped; line numbers count them anyway,
so an error's `line` is the line a text editor shows.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from carpool.server.batch.limits import BatchLimits


class InvalidBody(ValueError):
    """A request body the endpoint would refuse; `param` names the offending field (`messages[0].role`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class InvalidLine(ValueError):
    """What is wrong with one line of the input file, in the shape of a batch error."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


BodyCheck = Callable[[dict], None]  # raises InvalidBody


@dataclass
class Validation:
    total: int = 0
    errors: list[dict] = field(default_factory=list)
    num_errors: int = 0  # errors beyond `max_reported_errors` are counted, not listed


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, content) for each non-blank line, read lazily."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            raw = raw.strip()
            if raw:
                yield number, raw


def parse_line(raw: bytes, endpoint: str, check_body: BodyCheck) -> dict:
    """The request on one line, or InvalidLine saying what is wrong with it."""
    try:
        request = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise InvalidLine("invalid_json_line", f"This line is not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise InvalidLine("invalid_json_line", "Each line must be a JSON object.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidLine("missing_required_parameter", "custom_id must be a non-empty string.", "custom_id")
    if request.get("method") != "POST":
        raise InvalidLine("invalid_method", f"method must be 'POST', got {request.get('method')!r}.", "method")
    if request.get("url") != endpoint:
        raise InvalidLine(
            "invalid_url", f"url {request.get('url')!r} does not match the batch's endpoint {endpoint!r}.", "url"
        )
    body = request.get("body")
    if not isinstance(body, dict):
        raise InvalidLine("invalid_request", "body must be a JSON object.", "body")
    try:
        check_body(body)
    except InvalidBody as error:
        param = f"body.{error.param}" if error.param else "body"
        raise InvalidLine("invalid_request", error.message, param) from None
    return request


def validate_file(path: Path, endpoint: str, check_body: BodyCheck, limits: BatchLimits) -> Validation:
    result = Validation()
    seen: set[str] = set()

    def report(code: str, message: str, param: str | None = None, line: int | None = None) -> None:
        result.num_errors += 1
        if len(result.errors) < limits.max_reported_errors:
            result.errors.append({"code": code, "message": message, "param": param, "line": line})

    for number, raw in iter_lines(path):
        result.total += 1
        if result.total > limits.max_requests:
            report(
                "too_many_requests",
                f"The input file has more than {limits.max_requests} requests, the most one batch may hold.",
            )
            break
        try:
            request = parse_line(raw, endpoint, check_body)
        except InvalidLine as error:
            report(error.code, error.message, error.param, number)
            continue
        if request["custom_id"] in seen:
            message = f"custom_id {request['custom_id']!r} appears on an earlier line."
            report("duplicate_custom_id", message, "custom_id", number)
        seen.add(request["custom_id"])
    if result.total == 0:
        report("empty_file", "The input file holds no requests.")
    hidden = result.num_errors - len(result.errors)
    if hidden:
        result.errors.append(
            {"code": "too_many_errors", "message": f"{hidden} more lines have errors.", "param": None, "line": None}
        )
    return result
