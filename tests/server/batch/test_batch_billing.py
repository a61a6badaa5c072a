"""Each batch request reaches the gate as one UsageRecord at tier `batch`, billed to the key that made the batch."""

import json
import time

from fastapi.testclient import TestClient

from carpool.economics.contract import GateError, Principal
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.config import EngineConfig
from carpool.server.app import create_app

CALLER = Principal(key_id="key-1", tenant="acme")


class RecordingGate:
    def __init__(self):
        self.records = []

    def authenticate(self, api_key):
        return CALLER

    def admit(self, principal, tier, estimated_tokens, request_id=None, model=None):
        pass

    def record(self, principal, usage):
        self.records.append((principal, usage))

    def health(self):
        return None


class OverLimitGate(RecordingGate):
    """Every batch request is larger than the key's tokens-per-minute limit: waiting will never admit it."""

    def admit(self, principal, tier, estimated_tokens, request_id=None, model=None):
        if estimated_tokens > 0:  # the batch itself is admitted (0 tokens); each of its requests is refused
            raise GateError(
                429, "this request's tokens exceed the key's limit", "rate_limit_exceeded", retry_after=None
            )


def run_batch(gate, tmp_path, num_lines: int = 3) -> list[dict]:
    """Submit a small completions batch through the app, wait for it to complete, return its output lines."""
    app = create_app(AsyncEngine(EngineConfig(max_num_seqs=4, num_kv_blocks=64)), gate, "smol", batch_dir=str(tmp_path))
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"{i}, {i + 1},", "max_tokens": 3, "temperature": 0},
        }
        for i in range(num_lines)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with TestClient(app) as http:
        file_id = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
        batch = http.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        ).json()
        deadline = time.monotonic() + 60
        while batch["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        assert batch["status"] == "completed", batch
        file_id = batch["output_file_id"] or batch["error_file_id"]
        return [json.loads(line) for line in http.get(f"/v1/files/{file_id}/content").text.splitlines()]


def test_batch_requests_are_billed_at_the_batch_tier(tmp_path):
    gate = RecordingGate()
    output = run_batch(gate, tmp_path)
    bodies = {line["response"]["request_id"]: line["response"]["body"] for line in output}  # the ledger's id
    assert len(gate.records) == 3
    for principal, usage in gate.records:
        assert (usage.tier, usage.key_id, usage.tenant, principal.key_id) == ("batch", "key-1", "acme", "key-1")
        body = bodies[usage.request_id]
        assert usage.output_tokens == body["usage"]["completion_tokens"] == 3
        assert usage.prompt_tokens == body["usage"]["prompt_tokens"]


def test_a_refusal_waiting_cannot_cure_answers_the_line(tmp_path):
    """A rate-limit refusal with no retry time must not be retried forever: each line gets the 429."""
    output = run_batch(OverLimitGate(), tmp_path, num_lines=2)
    assert sorted(line["custom_id"] for line in output) == ["c0", "c1"]
    for line in output:
        assert line["response"]["status_code"] == 429
        assert line["response"]["body"]["error"]["code"] == "rate_limit_exceeded"
