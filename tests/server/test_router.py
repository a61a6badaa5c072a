"""A router served in process over two engines of the session's model ("cheap" and "strong"): it routes from the
prompt alone (a pure function of the text and the thresholds), runs and bills only the routed-to model, or that
model's step of its cascade onward, and names the chosen model in headers and ledger rows."""

import math
import os
import subprocess
import sys

import pytest

from carpool.server.app import create_app
from carpool.server.cascade.config import Cascade, Step
from carpool.server.cascade.router import BUCKETS, Router, prompt_features
from carpool.server.cascade.runner import ANSWERED_BY_HEADER, ROUTED_TO_HEADER, STEP_HEADER
from carpool.server.cascade.scorers import Scorer
from carpool.server.open_gate import RecordingGate
from tests.server.test_cascade import post

# P(cheap is right) = sigmoid(5 - 10 log1p(numbers in the prompt)): a prompt without numbers goes to the cheap
# model (0.99), one with two numbers to the strong one (0.002).
NUMBERS_WEIGHTS = ((0.0,) * BUCKETS + (0.0, 0.0, -10.0),)
PLAIN = "Name a colour."
NUMERIC = "What is 12 plus 7?"


def router(threshold: float = 0.5, cascade: str | None = None) -> Router:
    return Router("route", ("cheap", "strong"), (threshold,), NUMBERS_WEIGHTS, (5.0,), cascade)


def router_app(engine, strong_engine, threshold: float = 0.5, escalate: bool = False):
    gate = RecordingGate()
    named = {"route": router(threshold, "casc" if escalate else None)}
    # The cascade always escalates (a mean logprob is never above 0): route, then escalate the cheap answers.
    named["casc"] = Cascade("casc", (Step("cheap", Scorer("mean"), 1.0), Step("strong")))
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades=named)
    return app, gate


def chat(app, text: str, **extra):
    body = {"model": "route", "messages": [{"role": "user", "content": text}], "max_tokens": 5, "temperature": 0}
    return post(app, "/v1/chat/completions", body | extra)


def test_the_choice_is_a_pure_function_of_the_text_and_threshold():
    assert [router().route(PLAIN) for _ in range(3)] == [0, 0, 0]
    assert router().route(NUMERIC) == 1
    score = router().scores(PLAIN)[0]
    assert router(score).route(PLAIN) == 0 and router(math.nextafter(score, 1.0)).route(PLAIN) == 1
    # Not Python's salted hash(): another process, another hash seed, the same features.
    code = f"from carpool.server.cascade.router import prompt_features; print(prompt_features({NUMERIC!r}))"
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip() == str(prompt_features(NUMERIC))


@pytest.mark.parametrize("text,routed,step", [(PLAIN, "cheap", 0), (NUMERIC, "strong", 1)])
def test_a_routed_request_runs_and_bills_only_the_chosen_model(engine, strong_engine, text, routed, step):
    app, gate = router_app(engine, strong_engine)
    response = chat(app, text)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == routed
    assert response.headers[ROUTED_TO_HEADER] == routed and response.headers[ANSWERED_BY_HEADER] == routed
    assert response.headers[STEP_HEADER] == str(step)
    client_id = response.headers["x-request-id"]
    [row] = gate.records
    assert (row.model, row.purpose, row.cascade, row.cascade_step, row.cascade_accepted) == (
        routed,
        "cascade_attempt",
        "route",
        step,
        True,
    )
    assert row.parent_request_id == client_id and row.request_id == f"{client_id}#cascade-{step}"


def test_a_router_with_a_cascade_escalates_the_routed_to_cheap_answer(engine, strong_engine):
    app, gate = router_app(engine, strong_engine, escalate=True)
    response = chat(app, PLAIN)
    assert response.headers[ROUTED_TO_HEADER] == "cheap" and response.headers[ANSWERED_BY_HEADER] == "strong"
    rows = sorted(gate.records, key=lambda r: r.cascade_step)
    assert [(r.model, r.cascade, r.cascade_step, r.cascade_accepted) for r in rows] == [
        ("cheap", "route", 0, False),
        ("strong", "route", 1, True),
    ]
    app, gate = router_app(engine, strong_engine, escalate=True)
    response = chat(app, NUMERIC)  # routed to the strong model: no cheap attempt to pay for
    assert response.headers[ROUTED_TO_HEADER] == "strong"
    assert [(r.model, r.cascade_step) for r in gate.records] == [("strong", 1)]


def test_completions_route_text_and_refuse_token_ids(engine, strong_engine):
    app, gate = router_app(engine, strong_engine)
    body = {"model": "route", "prompt": NUMERIC, "max_tokens": 3, "temperature": 0}
    assert post(app, "/v1/completions", body).headers[ROUTED_TO_HEADER] == "strong"
    refused = post(app, "/v1/completions", body | {"prompt": [1, 2, 3]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert [r.model for r in gate.records] == ["strong"]


def test_models_lists_the_router(engine, strong_engine):
    import asyncio

    import httpx

    app, _ = router_app(engine, strong_engine, 0.3, escalate=True)

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            return (await client.get(path)).json()

    card = asyncio.run(get("/v1/models/route"))
    assert card["router"] == {
        "models": ["cheap", "strong"],
        "thresholds": [0.3],
        "features": "words",
        "cascade": "casc",
    }
    assert card["max_model_len"] == min(engine.max_model_len, strong_engine.max_model_len)


def test_a_routed_stream_is_the_routed_to_model_streaming_live(engine, strong_engine):
    app, gate = router_app(engine, strong_engine)
    response = chat(app, NUMERIC, stream=True)
    assert response.status_code == 200 and response.headers[ROUTED_TO_HEADER] == "strong"
    events = [line for line in response.text.splitlines() if line.startswith("data: {")]
    assert len(events) > 2 and all('"model": "strong"' in event or '"model":"strong"' in event for event in events)
    assert [(r.model, r.cascade_step) for r in gate.records] == [("strong", 1)]
