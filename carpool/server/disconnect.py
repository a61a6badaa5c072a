"""A whole (non-streamed) response waits for its generation, or for its client to hang up, whichever comes first."""

import asyncio

from fastapi import Request

from carpool.server.generation import Generation

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response


async def finished_before_disconnect(request: Request, gen: Generation) -> bool:
    """Wait for a whole response; a client that hangs up first cancels its generation."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher, finished = asyncio.create_task(disconnected()), asyncio.create_task(gen.done.wait())
    try:
        await asyncio.wait({watcher, finished}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        finished.cancel()
        if not gen.done.is_set():
            gen.cancel()
    return gen.done.is_set()
