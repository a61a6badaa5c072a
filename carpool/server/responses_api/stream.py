"""One streamed response as the Responses API's server-sent events, each `event: <type>` with its JSON (which
carries the type and a `sequence_number` from 0): `response.created`, `response.in_progress`, then per output item
`response.output_item.added` ... `response.output_item.done` (a message's `response.content_part.added`,
`response.output_text.delta`s, `response.output_text.done`, `response.content_part.done`; a call's
`response.function_call_arguments.delta` and `.done`), and last `response.completed` (or `response.incomplete`
when max_output_tokens cut it, `response.failed` when the engine or the ledger failed).

The chat pipeline's ChatFormat reads the engine's outputs, so text and calls are split exactly as on
/v1/chat/completions: text streams as it comes, a call goes out whole once its closing tag is written.
"""

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from carpool.economics.contract import GateError
from carpool.server.errors import APIError
from carpool.server.generation import Generation, GenerationFailed
from carpool.server.responses import ChatFormat
from carpool.server.responses_api.convert import call_item, finished_status, item_id, message_item, response_body
from carpool.server.responses_api.protocol import ResponsesRequest


class ResponseEvents:
    """`finish(response)` runs before the last event goes out (storing the response), so a client that saw
    `response.completed` can retrieve it or continue from it."""

    def __init__(
        self,
        body: ResponsesRequest,
        gen: Generation,
        fmt: ChatFormat,
        finish: Callable[[dict], Awaitable[None]],
    ):
        self.body, self.gen, self.fmt, self.finish = body, gen, fmt, finish
        self.sequence = 0
        self.output: list[dict] = []  # the items done so far
        self.text: str | None = None  # the open message's text, if one is open
        self.finish_reason: str | None = None

    async def events(self) -> AsyncIterator[str]:
        """Starlette cancels this when the client disconnects; its `finally` then aborts the engine request."""
        try:
            yield self._event("response.created", response=response_body(self.body, self.gen, "in_progress", []))
            yield self._event("response.in_progress", response=response_body(self.body, self.gen, "in_progress", []))
            async for choice, output in self.gen.stream():
                chunk = self.fmt.chunk(self.gen, choice, output)
                if chunk is not None:
                    for event in self._chunk(chunk["choices"][0]):
                        yield event
            for event in self._close_message(finished_status(self.finish_reason)):
                yield event
            status = finished_status(self.finish_reason)
            response = response_body(self.body, self.gen, status, self.output, int(time.time()))
            await self.finish(response)
            yield self._event(f"response.{status}", response=response)
        except GenerationFailed as error:
            yield self._failed("server_error", f"The engine failed while generating: {error}")
        except GateError as error:  # the usage could not be made durable: the response must not pass as a success
            yield self._failed(error.code, error.message)
        except APIError as error:
            yield self._failed(error.code or "server_error", error.message)
        finally:
            self.gen.cancel()

    def _chunk(self, choice: dict) -> list[str]:
        events, delta = [], choice["delta"]
        if delta.get("content"):
            if self.text is None:
                events += self._open_message()
            self.text += delta["content"]
            events.append(self._text_event("response.output_text.delta", delta=delta["content"]))
        for call in delta.get("tool_calls") or []:
            events += self._close_message("completed")
            index = len(self.output)
            item = call_item(item_id(self.gen, "fc", index), call)
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item=item | {"arguments": "", "status": "in_progress"},
                ),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
            self.output.append(item)
        self.finish_reason = choice["finish_reason"] or self.finish_reason
        return events

    def _open_message(self) -> list[str]:
        self.text = ""
        index = len(self.output)
        item = message_item(item_id(self.gen, "msg", index), "", "in_progress") | {"content": []}
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_text_part(""),
            ),
        ]

    def _close_message(self, status: str) -> list[str]:
        if self.text is None:
            return []
        index = len(self.output)
        item = message_item(item_id(self.gen, "msg", index), self.text, status)
        events = [
            self._text_event("response.output_text.done", text=self.text),
            self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_text_part(self.text),
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        self.text = None
        return events

    def _text_event(self, kind: str, **fields) -> str:
        index = len(self.output)
        return self._event(
            kind, item_id=item_id(self.gen, "msg", index), output_index=index, content_index=0, logprobs=[], **fields
        )

    def _failed(self, code: str, message: str) -> str:
        error = {"code": code, "message": message}
        return self._event(
            "response.failed", response=response_body(self.body, self.gen, "failed", self.output, error=error)
        )

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
