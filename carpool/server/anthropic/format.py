"""A Generation as Anthropic's `message`: content blocks, stop reason and usage, whole or as stream events.

Tool calls are found in the output by the chat route's own parser (carpool.server.tool_calls), so a call is a
`tool_use` block exactly when the OpenAI route would have made it a `tool_calls` entry.
"""

import json
from collections.abc import Iterator, Mapping

from carpool.engine.outputs import RequestOutput
from carpool.engine.tiers import BATCH_TIER
from carpool.server.generation import Generation
from carpool.server.tool_calls import ToolCallParser, parse_tool_calls

# Anthropic's names for what a usage was served as; carpool's other tiers keep their own names.
_USAGE_TIERS = {"default": "standard", BATCH_TIER: "batch"}


class MessageFormat:
    """One request's formatter. `tools`: each rendered tool's name and input schema (None: no tools rendered);
    `stops`: the request's stop_sequences."""

    def __init__(self, tokenizer, tools: Mapping[str, dict | None] | None, stops: list[str]):
        self.tokenizer, self.tools, self.stops = tokenizer, tools, stops
        # Streaming state: the parser, the open text block's index, the next block's index, the stop reason.
        self._parser = ToolCallParser(tools) if tools is not None else None
        self._open_text: int | None = None
        self._next_index = 0
        self._stop: tuple[str, str | None] = ("end_turn", None)

    # Whole ------------------------------------------------------------------------------------------------

    def response(self, gen: Generation) -> dict:
        output = gen.choices[0].last
        content, calls = parse_tool_calls(output.text, self.tools) if self.tools is not None else (output.text, [])
        blocks = [{"type": "text", "text": content}] if content else []
        blocks += [_tool_use(call) for call in calls]
        stop_reason, stop_sequence = self.stop_reason(output, bool(calls))
        return self.envelope(gen) | {
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(gen),
        }

    def envelope(self, gen: Generation) -> dict:
        return {
            "id": message_id(gen.request_id),
            "type": "message",
            "role": "assistant",
            "model": gen.model_name,
        }

    def stop_reason(self, output: RequestOutput, called: bool) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence. The engine cuts the output's text before the stop string
        that ended it (RequestOutput says only "stop"); the string is what the whole output's tokens spell after
        the text, so the detokenizer's own decode finds it."""
        if output.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if self.stops and output.finish_reason == "stop":
            after = self.tokenizer.decode(output.token_ids)[len(output.text) :]
            matched = next((stop for stop in self.stops if after.startswith(stop)), None)
            if matched is not None:
                return "stop_sequence", matched
        return "end_turn", None

    @staticmethod
    def usage(gen: Generation) -> dict:
        """Anthropic's split of the prompt: tokens read from the cache, tokens written under a breakpoint (by TTL),
        and the rest (`input_tokens`). A prefix the engine did not pin (shorter than the minimum, or past the
        pinned-memory bound) is cached as an ordinary prefix and counted, and billed, as input."""
        record = gen.usage_record()
        written = record.cache_write_5m_tokens + record.cache_write_1h_tokens
        return {
            "input_tokens": record.prompt_tokens - record.cached_tokens - written,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": record.cached_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": record.cache_write_5m_tokens,
                "ephemeral_1h_input_tokens": record.cache_write_1h_tokens,
            },
            "output_tokens": record.output_tokens,
            "service_tier": _USAGE_TIERS.get(record.tier, record.tier),
        }

    # Streamed ---------------------------------------------------------------------------------------------

    def start_event(self, gen: Generation) -> dict:
        message = self.envelope(gen) | {"content": [], "stop_reason": None, "stop_sequence": None}
        return {"type": "message_start", "message": message | {"usage": self.usage(gen)}}

    def events(self, output: RequestOutput) -> Iterator[dict]:
        """The content block events one engine output adds."""
        if self._parser is not None:
            text, calls = self._parser.feed(output.text, output.finished)
        else:
            text, calls = output.delta_text, []
        if text:
            if self._open_text is None:
                self._open_text = self._take_index()
                yield {
                    "type": "content_block_start",
                    "index": self._open_text,
                    "content_block": {"type": "text", "text": ""},
                }
            yield {
                "type": "content_block_delta",
                "index": self._open_text,
                "delta": {"type": "text_delta", "text": text},
            }
        for call in calls:
            yield from self._close_text()
            index = self._take_index()
            block = _tool_use(call)
            yield {"type": "content_block_start", "index": index, "content_block": block | {"input": {}}}
            partial = json.dumps(block["input"], ensure_ascii=False)
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": partial},
            }
            yield {"type": "content_block_stop", "index": index}
        if output.finished:
            yield from self._close_text()
            self._stop = self.stop_reason(output, bool(self._parser and self._parser.calls))

    def end_events(self, gen: Generation) -> Iterator[dict]:
        """Once the usage is durable: the stop reason and the whole usage, then the end."""
        stop_reason, stop_sequence = self._stop
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": self.usage(gen),
        }
        yield {"type": "message_stop"}

    def _close_text(self) -> Iterator[dict]:
        if self._open_text is not None:
            yield {"type": "content_block_stop", "index": self._open_text}
            self._open_text = None

    def _take_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1


def message_id(request_id: str) -> str:
    """`msg_...` for the chat pipeline's `chatcmpl-...`: the same hex, so a message and its ledger row meet."""
    return "msg_" + request_id.partition("-")[2]


def _tool_use(call: dict) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }
