"""A prompt-pass router (features = "prompt-pass") served in process over two engines of the session's model: the
cheap model's one prefill of the prompt gives the surprisal features (the same as calibration computes offline),
is billed once as a row of its own, and the routed-to cheap model reads that prompt's KV from the prefix cache."""

import math
import uuid

import pytest

from carpool.economics.prices import load_price_sheet
from carpool.server.app import create_app
from carpool.server.cascade.prompt_pass import PART
from carpool.server.cascade.router import BUCKETS, Router, pass_features
from carpool.server.cascade.runner import ROUTED_TO_HEADER
from carpool.server.cascade.runs import Example, run_prompt_passes
from carpool.server.open_gate import RecordingGate
from tests.server.test_cascade import post

# P(cheap is right) = sigmoid(mean surprisal of the prompt + bias): the words are given no weight, so the route
# depends on the cheap model's pass alone.
PASS_WEIGHTS = ((0.0,) * (BUCKETS + 3) + (1.0, 0.0, 0.0, 0.0, 0.0, 0.0),)


def router(bias: float) -> Router:
    return Router("route", ("cheap", "strong"), (0.5,), PASS_WEIGHTS, (bias,), features="prompt-pass")


def chat(app, text: str):
    body = {"model": "route", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0}
    return post(app, "/v1/chat/completions", body)


FRESH = f"Name a colour, please ({uuid.uuid4().hex[:6]})."


def passes(llm, *texts: str):
    return run_prompt_passes("cheap", [Example(text) for text in texts], load_price_sheet(None).cost, llm=llm)


@pytest.fixture(scope="module")
def offline_mean(llm):
    """FRESH's mean surprisal as calibration computes it, on the session's LLM before this module's engine runs
    over it (one engine, one caller at a time)."""
    return pass_features(passes(llm, FRESH)[0].surprisals)[0]


def test_the_prompt_pass_features_are_deterministic_for_a_prompt(llm):
    text = "Which desk takes: my invoice is wrong?"
    [first], [second] = passes(llm, text), passes(llm, text)
    batched = passes(llm, "Another prompt, longer than the first one, in the same batch.", text)[1]
    assert pass_features(first.surprisals) == pass_features(second.surprisals) == pass_features(batched.surprisals)
    assert len(first.surprisals) == first.prompt_tokens - 1 and all(math.isfinite(s) for s in first.surprisals)


def test_the_served_pass_routes_as_calibration_scored_it(offline_mean, engine, strong_engine):
    text, mean = FRESH, offline_mean
    # A threshold (-bias) just below the prompt's own mean surprisal sends it to the cheap model, just above to the
    # strong one:
    # the server's pass reads the same surprisals as the offline one, to 1e-4 nats.
    for bias, routed in ((1e-4 - mean, "cheap"), (-1e-4 - mean, "strong")):
        app = create_app({"cheap": engine, "strong": strong_engine}, RecordingGate(), cascades={"route": router(bias)})
        response = chat(app, text)
        assert response.status_code == 200, response.text
        assert response.headers[ROUTED_TO_HEADER] == routed


def test_the_pass_is_billed_once_and_the_cheap_answer_reads_its_kv_from_the_cache(engine, strong_engine):
    gate = RecordingGate()
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"route": router(100.0)})
    text = f"Which desk takes this message from a customer: my parcel never came ({uuid.uuid4().hex})?"
    response = chat(app, text)
    assert response.status_code == 200, response.text
    assert response.headers[ROUTED_TO_HEADER] == "cheap"
    client_id = response.headers["x-request-id"]
    passes = [r for r in gate.records if r.request_id == f"{client_id}#{PART}"]
    [passed] = passes
    [answer] = [r for r in gate.records if r.request_id == f"{client_id}#cascade-0"]
    assert len(gate.records) == 2
    assert (passed.model, passed.purpose, passed.parent_request_id) == ("cheap", "cascade_attempt", client_id)
    assert (passed.cascade, passed.cascade_step, passed.cascade_accepted) == ("route", 0, False)
    assert passed.prompt_tokens == answer.prompt_tokens and passed.output_tokens == 1 and passed.cached_tokens == 0
    # The prompt is new (a fresh uuid): every cached token the answer reads was written by the pass.
    assert answer.cached_tokens >= (answer.prompt_tokens - 1) // 16 * 16 > 0


def test_a_pass_routed_to_the_strong_model_bills_the_pass_and_the_strong_answer(engine, strong_engine):
    gate = RecordingGate()
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"route": router(-100.0)})
    response = chat(app, f"Name a fruit ({uuid.uuid4().hex[:6]}).")
    assert response.headers[ROUTED_TO_HEADER] == "strong"
    assert sorted((r.model, r.cascade_step, r.cascade_accepted) for r in gate.records) == [
        ("cheap", 0, False),
        ("strong", 1, True),
    ]


def test_a_completion_is_passed_on_its_text_and_its_cheap_answer_reads_the_pass(engine, strong_engine):
    gate = RecordingGate()
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"route": router(100.0)})
    prompt = f"A customer wrote: my card was charged twice for order {uuid.uuid4().hex}. The desk is"
    response = post(app, "/v1/completions", {"model": "route", "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    client_id = response.headers["x-request-id"]
    rows = {r.request_id: r for r in gate.records}
    passed, answer = rows[f"{client_id}#{PART}"], rows[f"{client_id}#cascade-0"]
    assert len(rows) == 2 and passed.prompt_tokens == answer.prompt_tokens
    assert answer.cached_tokens >= (answer.prompt_tokens - 1) // 16 * 16 > 0
