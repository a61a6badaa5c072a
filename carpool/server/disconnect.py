"""A whole (non-streamed) response waits for its generation; a client that hangs up first cancels it."""

import asyncio

from fastapi import Request

from carpool.server.generation import Generation

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response


async def disconnected(request: Request) -> None:
    """Returns once the client has hung up (the body was read already: what is left to receive is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def finished_before_disconnect(request: Request, gen: Generation) -> bool:
    """Wait for a whole (non-streamed) response; a client that hangs up first cancels its generation."""
    watcher, finished = asyncio.create_task(disconnected(request)), asyncio.create_task(gen.done.wait())
    try:
        await asyncio.wait({watcher, finished}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        finished.cancel()
        if not gen.done.is_set():
            gen.cancel()
    return gen.done.is_set()
