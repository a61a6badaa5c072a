"""A stand-in endpoint, so the store, validation and runner are tested without a model."""

import asyncio
import json

from carpool.server.batch.runner import Outcome
from carpool.server.batch.validation import InvalidBody
from carpool.server.errors import error_body


class EchoEndpoint:
    """Answers each body with its prompt reversed, after `delay` seconds; counts what it started and finished."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.started: list[str] = []
        self.finished: list[str] = []
        self.peak_in_flight = 0
        self.principals = []
        self._in_flight = 0

    def check_body(self, body: dict) -> None:
        if not isinstance(body.get("prompt"), str):
            raise InvalidBody("prompt must be a string", "prompt")

    async def run(self, principal, body: dict, line=None) -> Outcome:
        self.started.append(body["prompt"])
        self.principals.append(principal)
        self._in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self._in_flight -= 1
        self.finished.append(body["prompt"])
        if body["prompt"] == "too long":
            return Outcome(400, error_body(400, "prompt too long", "prompt"), "cmpl-refused")
        body = {"object": "text_completion", "text": body["prompt"][::-1]}
        return Outcome(200, body, "cmpl-1", prompt_tokens=3, cached_tokens=1, output_tokens=2)


def request_line(custom_id: str, prompt: str, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": prompt}})


def write_lines(path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))
