"""The app in process, around the session's engine: the gate protocol (an injected gate is asked who calls and
whether to admit, and gets exactly one usage record per request) and an engine that has failed."""

import asyncio

import httpx
import pytest

from carpool.economics.contract import GateError, Principal
from carpool.server.app import create_app

GOOD_KEY = "sk-good"
MESSAGES = [{"role": "user", "content": "Hi"}]


class RecordingGate:
    """Knows one key; refuses the priority tier for lack of budget; keeps every usage record."""

    def __init__(self):
        self.admitted, self.records = [], []

    def authenticate(self, api_key):
        if api_key != GOOD_KEY:
            raise GateError(401, "unknown key", "invalid_api_key")
        return Principal(key_id="good", tenant="acme")

    def admit(self, principal, tier, estimated_tokens, request_id=None, model=None):
        if tier == "priority":
            raise GateError(429, "priority budget spent", "insufficient_quota", retry_after=30)
        self.admitted.append((tier, estimated_tokens))

    def record(self, principal, usage):
        self.records.append((principal, usage))

    def health(self):
        return None


@pytest.fixture
def gate_app(engine):
    gate = RecordingGate()
    return create_app(engine, gate, model_name="tiny"), gate


def call(app, path, body=None, key=GOOD_KEY):
    """POST body to path (GET without one) and return the response."""

    async def send():
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://carpool", headers=headers) as client:
            return await (client.get(path) if body is None else client.post(path, json=body))

    return asyncio.run(send())


def test_unknown_key_is_refused_before_anything_else(gate_app):
    app, gate = gate_app
    response = call(app, "/v1/chat/completions", {"messages": "not even valid"}, key="sk-bad")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert gate.admitted == [] and gate.records == []


def test_one_usage_record_per_request(gate_app, tokenizer):
    app, gate = gate_app
    response = call(
        app,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 3, "n": 2, "temperature": 0, "service_tier": "flex", "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    prompt_tokens = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES)))
    assert gate.admitted == [("flex", 2 * (prompt_tokens + 3))]
    [(principal, record)] = gate.records
    assert principal.tenant == "acme"
    assert (record.model, record.tier, record.key_id, record.tenant) == ("tiny", "flex", "good", "acme")
    assert record.request_id == response.headers["x-request-id"]  # the id the client holds, not the body's
    assert record.prompt_tokens == usage["prompt_tokens"] == prompt_tokens  # n choices share one prompt
    assert record.output_tokens == usage["completion_tokens"] == 6
    assert record.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]
    assert record.finish_reason == "length"
    assert min(record.queue_seconds, record.prefill_seconds, record.decode_seconds) >= 0
    assert record.decode_seconds > 0


def test_refused_admission_keeps_the_gates_status_and_records_nothing(gate_app):
    app, gate = gate_app
    response = call(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "service_tier": "priority"})
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "30"
    assert response.json()["error"]["code"] == "insufficient_quota"
    assert gate.records == []
    assert call(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert len(gate.records) == 1


def test_a_failed_engine_is_a_server_error_not_a_hang(gate_app, engine):
    app, gate = gate_app
    engine.error = RuntimeError("the engine thread died")
    try:
        response = call(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        health = call(app, "/health")
    finally:
        engine.error = None
    # Known failed before the request starts: refused as unavailable, nothing run and nothing billed (a request
    # that was running when it failed gets the 500: tests/server/test_engine_isolation.py).
    assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
    assert response.json()["error"]["code"] == "model_unavailable"
    assert health.status_code == 503
    assert gate.records == []
