"""Anthropic's stream of server-sent events for one message: `message_start`, a `ping`, each content block's
`content_block_start` / `content_block_delta` (text_delta, input_json_delta) / `content_block_stop`, then
`message_delta` with the stop reason and the whole usage, and `message_stop`; an `error` event if it fails.

`message_start` goes out with the first output, after the prefill, so that its usage already splits the prompt
into cache reads, writes and input as the message_delta's will. A tool call's block is sent whole once its call
is complete (the parser holds a call back until it closes): one input_json_delta with the whole input.
"""

import json
from collections.abc import AsyncIterator

from carpool.economics.contract import GateError
from carpool.server.anthropic.errors import anthropic_error
from carpool.server.anthropic.format import MessageFormat
from carpool.server.generation import Generation, GenerationFailed


async def message_events(gen: Generation, fmt: MessageFormat) -> AsyncIterator[str]:
    """Starlette cancels this when the client disconnects, which aborts the engine request."""
    started = False
    try:
        async for _, output in gen.stream():
            if not started:
                started = True
                yield _event(fmt.start_event(gen))
                yield _event({"type": "ping"})
            for event in fmt.events(output):
                yield _event(event)
        if not started:
            yield _event(fmt.start_event(gen))
        for event in fmt.end_events(gen):
            yield _event(event)
    except GenerationFailed as error:
        yield _event(anthropic_error(500, f"The engine failed while generating: {error}"))
    except GateError as error:  # the usage could not be made durable: the stream must not end as a success
        yield _event(anthropic_error(error.status, error.message))
    finally:
        gen.cancel()


def _event(body: dict) -> str:
    return f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
