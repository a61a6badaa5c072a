"""A client that hangs up while its request is admitted on a worker thread (a PostgreSQL gate's admission is a round
trip to the database) gets nothing started: no engine work, a 499, and a row of no tokens that settles what its
admission reserved."""

import asyncio
import json
import time

from carpool.server.app import create_app
from carpool.server.open_gate import RecordingGate

BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


class SlowRemoteGate(RecordingGate):
    """Admission that waits on a database server for a second."""

    admits_remotely = True

    def admit(self, *args, **kwargs):
        time.sleep(1.0)
        super().admit(*args, **kwargs)


def call_and_hang_up(app, after: float) -> list[dict]:
    """POST the body, then hang up `after` seconds later; the ASGI messages the app sent."""
    sent: list[dict] = []
    waiting = [{"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}]

    async def receive():
        if waiting:
            return waiting.pop()
        await asyncio.sleep(after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"carpool")],
        "client": ("127.0.0.1", 1),
        "server": ("carpool", 80),
    }
    asyncio.run(app(scope, receive, send))
    return sent


def test_a_client_gone_during_admission_starts_no_generation(engine):
    gate = SlowRemoteGate()
    stepped: list[str] = []
    engine.add_step_listener(lambda stats, outputs: stepped.extend(output.request_id for output in outputs))
    app = create_app(engine, gate, model_name="tiny")
    sent = call_and_hang_up(app, after=0.2)
    time.sleep(0.5)  # an engine request, had one been sent, would have stepped by now
    assert sent[0]["status"] == 499
    assert stepped == []
    ((_, usage),) = [(None, record) for record in gate.records]
    assert (usage.finish_reason, usage.prompt_tokens, usage.output_tokens) == ("abort", 0, 0)
    assert usage.request_id == gate.admitted[0]  # the row settles the admission
