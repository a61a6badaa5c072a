"""A cascade served in process over two engines of the session's model ("cheap" and "strong"): it escalates
exactly when its scorer is below the threshold, bills every attempt as its own row tied to the client request,
streams only the accepted step, and answers with the model that answered."""

import asyncio
import json
import math

import httpx
import pytest

from carpool.economics.contract import GateError
from carpool.server.app import create_app
from carpool.server.cascade.config import Cascade, Step
from carpool.server.cascade.runner import ANSWERED_BY_HEADER, ESCALATION_REFUSED_HEADER, STEP_HEADER
from carpool.server.cascade.scorers import Scorer
from carpool.server.open_gate import RecordingGate

MESSAGES = [{"role": "user", "content": "Name a colour."}]
BODY = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}


def cascade_app(engine, strong_engine, threshold: float, kind: str = "mean"):
    gate = RecordingGate()
    cascade = Cascade("casc", (Step("cheap", Scorer(kind), threshold), Step("strong")))
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"casc": cascade})
    return app, gate


def post(app, path, body):
    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://carpool") as client:
            return await client.post(path, json=body)

    return asyncio.run(send())


def cheap_score(app, kind: str = "mean", path="/v1/chat/completions", body=BODY) -> float:
    """The cheap model's own score for the answer it gives, asked of it directly (exact fp32: deterministic)."""
    logprobs = {"logprobs": True} if path.endswith("chat/completions") else {"logprobs": 0}
    # Twice: the first call caches the prompt's full blocks, so this score and the cascade's own runs all read
    # them from the prefix cache (a cold prefill's attention rounds differently from a cached one's).
    post(app, path, body | {"model": "cheap"})
    response = post(app, path, body | {"model": "cheap"} | logprobs).json()
    content = response["choices"][0]["logprobs"]
    tokens = content["content"] if "content" in content else [{"logprob": lp} for lp in content["token_logprobs"]]
    return Scorer(kind).score([t["logprob"] for t in tokens], response["choices"][0]["finish_reason"] == "length")


@pytest.mark.parametrize("kind", ["mean", "min", "tail"])
def test_escalates_exactly_when_the_score_is_below_the_threshold(engine, strong_engine, kind):
    app, _ = cascade_app(engine, strong_engine, 0.0)
    score = cheap_score(app, kind)
    assert score < 0
    at, _ = cascade_app(engine, strong_engine, score, kind)
    answered = post(at, "/v1/chat/completions", BODY | {"model": "casc"})
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] == "cheap" and answered.headers[STEP_HEADER] == "0"
    assert answered.headers[ANSWERED_BY_HEADER] == "cheap"
    above, _ = cascade_app(engine, strong_engine, math.nextafter(score, math.inf), kind)
    escalated = post(above, "/v1/chat/completions", BODY | {"model": "casc"})
    assert escalated.json()["model"] == "strong" and escalated.headers[STEP_HEADER] == "1"
    assert escalated.headers[ANSWERED_BY_HEADER] == "strong"


def test_every_attempt_is_a_ledger_row_tied_to_the_client_request(engine, strong_engine):
    app, gate = cascade_app(engine, strong_engine, 1.0)  # a logprob mean is never above 0: always escalates
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc"})
    assert response.status_code == 200
    client_id = response.headers["x-request-id"]
    rows = sorted(gate.records, key=lambda r: r.cascade_step)
    assert [(r.model, r.cascade_step, r.cascade_accepted) for r in rows] == [("cheap", 0, False), ("strong", 1, True)]
    assert {(r.purpose, r.parent_request_id, r.cascade) for r in rows} == {("cascade_attempt", client_id, "casc")}
    assert [r.request_id for r in rows] == [f"{client_id}#cascade-0", f"{client_id}#cascade-1"]
    assert all(r.output_tokens > 0 for r in rows)
    app, gate = cascade_app(engine, strong_engine, -math.inf)
    post(app, "/v1/chat/completions", BODY | {"model": "casc"})
    assert [(r.model, r.cascade_step, r.cascade_accepted) for r in gate.records] == [("cheap", 0, True)]


def stream_text(app, body) -> tuple[httpx.Response, list[dict]]:
    response = post(app, "/v1/chat/completions", body | {"stream": True})
    events = [
        json.loads(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    return response, events


@pytest.mark.parametrize("threshold,answerer", [(-math.inf, "cheap"), (1.0, "strong")])
def test_streams_the_accepted_step_only(engine, strong_engine, threshold, answerer):
    app, _ = cascade_app(engine, strong_engine, threshold)
    direct = post(app, "/v1/chat/completions", BODY | {"model": answerer}).json()["choices"][0]["message"]
    response, events = stream_text(app, BODY | {"model": "casc"})
    assert response.headers[ANSWERED_BY_HEADER] == answerer
    assert {event["model"] for event in events} == {answerer}
    text = "".join(event["choices"][0]["delta"].get("content") or "" for event in events)
    assert text == direct["content"] and len(events) > 2  # streamed token by token, not one block
    assert all(event["choices"][0].get("logprobs") is None for event in events)  # the scorer's, not asked for


def test_completions_answer_without_logprobs_unless_asked(engine, strong_engine):
    body = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0}
    app, _ = cascade_app(engine, strong_engine, 0.0)
    score = cheap_score(app, path="/v1/completions", body=body)
    at, _ = cascade_app(engine, strong_engine, score)
    response = post(at, "/v1/completions", body | {"model": "casc"})
    assert response.json()["model"] == "cheap" and response.json()["choices"][0]["logprobs"] is None
    asked = post(at, "/v1/completions", body | {"model": "casc", "logprobs": 0}).json()
    assert len(asked["choices"][0]["logprobs"]["token_logprobs"]) == asked["usage"]["completion_tokens"]


def test_a_cascade_answers_one_choice(engine, strong_engine):
    app, gate = cascade_app(engine, strong_engine, 0.0)
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc", "n": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert gate.records == []


def test_a_logistic_score_far_past_the_exponent_range_is_zero_or_one():
    far = Scorer("logistic", weights=(100.0, 0.0, 0.0, 0.0, 0.0))
    assert far.score([-20.0]) == 0.0 and far.score([], False) == 0.0
    assert Scorer("logistic", weights=(-100.0, 0.0, 0.0, 0.0, 0.0)).score([-20.0]) == 1.0


class FailingScorer:
    def score(self, logprobs, hit_length=False):
        raise OverflowError("math range error")


def test_a_scorer_that_raises_escalates_and_its_row_is_still_written(engine, strong_engine):
    gate = RecordingGate()
    cascade = Cascade("casc", (Step("cheap", FailingScorer(), 0.0), Step("strong")))
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"casc": cascade})
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc"})
    assert response.status_code == 200 and response.headers[ANSWERED_BY_HEADER] == "strong"
    assert [(r.model, r.cascade_accepted) for r in gate.records] == [("cheap", False), ("strong", True)]


def test_a_last_step_that_failed_is_not_accepted(engine, strong_engine, monkeypatch):
    app, gate = cascade_app(engine, strong_engine, 1.0)  # always escalates to the last step

    async def broken(request):
        raise RuntimeError("engine stopped")
        yield

    monkeypatch.setattr(strong_engine, "generate", broken)
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc"})
    assert response.status_code == 500
    assert [(r.model, r.cascade_accepted) for r in gate.records] == [("cheap", False), ("strong", False)]


class SpentOnStrong(RecordingGate):
    """The budget holds the cheap step and not the strong one."""

    def admit(self, principal, tier, estimated_tokens, request_id=None, model=None):
        if model == "strong":
            raise GateError(429, "The key's budget is spent.", "insufficient_quota")
        super().admit(principal, tier, estimated_tokens, request_id, model)


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_escalation_delivers_the_billed_answer_instead_of_an_error(engine, strong_engine, stream):
    """Before: the cheap attempt was billed and the client answered 429, "billed without delivery" (issue 55)."""
    gate = SpentOnStrong()
    cascade = Cascade("casc", (Step("cheap", Scorer("mean"), 1.0), Step("strong")))  # always escalates
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"casc": cascade})
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc", "stream": stream})
    assert response.status_code == 200, response.text
    assert response.headers[STEP_HEADER] == "0" and response.headers[ANSWERED_BY_HEADER] == "cheap"
    assert response.headers[ESCALATION_REFUSED_HEADER] == "429 insufficient_quota"
    [row] = gate.records
    assert (row.model, row.cascade_accepted, row.output_tokens > 0) == ("cheap", False, True)
    if stream:
        assert "data: [DONE]" in response.text and '"logprobs": {' not in response.text
    else:
        assert response.json()["choices"][0]["message"]["content"]
        assert response.json()["choices"][0]["logprobs"] is None


class LedgerFailsForStrong(RecordingGate):
    """The cheap step's row is written; the strong step's write fails (the ledger's disk full meanwhile)."""

    def record(self, principal, usage):
        if usage.model == "strong":
            raise OSError(28, "No space left on device")
        super().record(principal, usage)


def test_an_escalation_whose_row_could_not_be_written_delivers_the_billed_answer(engine, strong_engine):
    """Before: the strong answer was withheld (503 usage_not_recorded) and the cheap attempt stayed billed: the
    soak's cascades "billed without delivery" in its full-disk and PostgreSQL-down windows (issue 55)."""
    gate = LedgerFailsForStrong()
    cascade = Cascade("casc", (Step("cheap", Scorer("mean"), 1.0), Step("strong")))  # always escalates
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"casc": cascade})
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc"})
    assert response.status_code == 200, response.text
    assert response.headers[ANSWERED_BY_HEADER] == "cheap"
    assert response.headers[ESCALATION_REFUSED_HEADER] == "503 usage_not_recorded"
    [row] = gate.records
    assert (row.model, row.cascade_accepted) == ("cheap", False)
    assert response.json()["choices"][0]["message"]["content"]


def test_a_refused_first_step_is_the_error(engine, strong_engine):
    class SpentOnCheap(RecordingGate):
        def admit(self, principal, tier, estimated_tokens, request_id=None, model=None):
            raise GateError(429, "The key's budget is spent.", "insufficient_quota")

    gate = SpentOnCheap()
    cascade = Cascade("casc", (Step("cheap", Scorer("mean"), 1.0), Step("strong")))
    app = create_app({"cheap": engine, "strong": strong_engine}, gate, cascades={"casc": cascade})
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc"})
    assert response.status_code == 429 and gate.records == []


def test_a_body_the_last_step_refuses_runs_no_step(engine, strong_engine):
    """Steps before the last get logprobs turned on, so top_logprobs alone passes them and fails the last."""
    app, gate = cascade_app(engine, strong_engine, 1.0)
    response = post(app, "/v1/chat/completions", BODY | {"model": "casc", "top_logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    assert gate.records == []


def test_models_lists_the_cascade_with_its_steps(engine, strong_engine):
    app, _ = cascade_app(engine, strong_engine, -1.5, "tail")

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            return (await client.get(path)).json()

    listed = asyncio.run(get("/v1/models"))["data"]
    assert [card["id"] for card in listed] == ["cheap", "strong", "casc"]
    card = listed[-1]
    assert card["object"] == "model" and "cascade" not in listed[0]
    assert card["cascade"]["steps"] == [{"model": "cheap", "scorer": "tail", "threshold": -1.5}, {"model": "strong"}]
    assert card["max_model_len"] == min(engine.max_model_len, strong_engine.max_model_len)
    assert asyncio.run(get("/v1/models/casc")) == card
    assert asyncio.run(get("/v1/models/nope"))["error"]["code"] == "model_not_found"
