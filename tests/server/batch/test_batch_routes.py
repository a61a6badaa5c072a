"""The Files and Batches routes in process, over a fake endpoint: limits, refusals, paging and who sees what."""

import time
from contextlib import asynccontextmanager
from typing import ClassVar

import pytest
from batch_fakes import EchoEndpoint, request_line
from fastapi import FastAPI
from fastapi.testclient import TestClient

from carpool.economics.contract import (
    BATCHES_READ_ALL,
    FILES_READ_ALL,
    SCOPES,
    USAGE_READ,
    GateError,
    Principal,
)
from carpool.server.auth import Authenticate
from carpool.server.batch.limits import BatchLimits
from carpool.server.batch.routes import create_batch_router
from carpool.server.batch.runner import BatchRunner
from carpool.server.batch.store import BatchStore
from carpool.server.errors import install_error_handlers

LIMITS = BatchLimits(max_file_bytes=2000, max_requests=5)


class KeyedGate:
    PRINCIPALS: ClassVar[dict[str, Principal]] = {
        "key-a": Principal(key_id="a", tenant="acme"),
        "key-a2": Principal(key_id="a2", tenant="acme"),
        "key-b": Principal(key_id="b", tenant="globex"),
        "key-root": Principal(key_id="root", scopes=frozenset(SCOPES)),
        "key-ops": Principal(key_id="ops", tenant="ops", scopes=frozenset({USAGE_READ, BATCHES_READ_ALL})),
        "key-reader": Principal(key_id="reader", tenant="audit", scopes=frozenset({FILES_READ_ALL})),
        "key-interactive": Principal(key_id="i", tenant="acme", allowed_tiers=frozenset({"default"})),
    }

    def authenticate(self, api_key):
        if api_key not in self.PRINCIPALS:
            raise GateError(401, "Incorrect API key.", "invalid_api_key")
        return self.PRINCIPALS[api_key]

    def __init__(self):
        self.audited = []

    def admit(self, principal, tier, estimated_tokens, request_id=None, model=None):
        if principal.allowed_tiers is not None and tier not in principal.allowed_tiers:
            raise GateError(403, f"service_tier {tier!r} is not allowed for this key", "tier_not_allowed")

    def record(self, principal, usage):
        pass

    def audit(self, principal, action, target, owner):
        self.audited.append((principal.key_id, action, target, owner))

    def health(self):
        return None


@pytest.fixture
def app(tmp_path):
    store = BatchStore(tmp_path)
    # Each request takes a moment, so a batch is still running when a test acts on it.
    runner = BatchRunner(store, {"/v1/completions": EchoEndpoint(delay=0.1)}, LIMITS, 4)

    @asynccontextmanager
    async def lifespan(app):
        await runner.start()
        yield
        await runner.stop()

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)
    app.state.gate = gate = KeyedGate()
    app.add_middleware(Authenticate, gate=gate)
    app.include_router(create_batch_router(store, runner, gate, LIMITS))
    return app


@pytest.fixture
def http(app):
    with TestClient(app) as client:
        yield client


def as_key(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def upload(http, lines: list[str], key: str = "key-a", purpose: str = "batch"):
    data = "".join(line + "\n" for line in lines).encode()
    return http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": purpose}, headers=as_key(key))


def create(http, file_id: str, key: str = "key-a", **overrides):
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h", **overrides}
    return http.post("/v1/batches", json=body, headers=as_key(key))


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def wait_for_end(http, batch_id: str, key: str = "key-a") -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        batch = http.get(f"/v1/batches/{batch_id}", headers=as_key(key)).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.01)
    raise AssertionError(batch)


def test_a_file_over_the_size_limit_is_a_clear_400(http):
    error = error_of(upload(http, [request_line("a", "x" * 3000)]), 400)
    assert error["code"] == "file_too_large" and "2000 bytes" in error["message"]


def test_more_requests_than_a_batch_may_hold_fail_it(http):
    file_id = upload(http, [request_line(f"r{i}", "x") for i in range(6)]).json()["id"]
    batch = wait_for_end(http, create(http, file_id).json()["id"])
    assert batch["status"] == "failed"
    assert [e["code"] for e in batch["errors"]["data"]] == ["too_many_requests"]


def test_malformed_requests_are_400s_naming_the_parameter(http):
    file_id = upload(http, [request_line("a", "x")]).json()["id"]
    assert error_of(create(http, file_id, endpoint="/v1/embeddings"), 400)["param"] == "endpoint"
    assert error_of(create(http, file_id, completion_window="48h"), 400)["param"] == "completion_window"
    too_many = {f"k{i}": "v" for i in range(17)}
    assert error_of(create(http, file_id, metadata=too_many), 400)["param"] == "metadata"
    assert error_of(create(http, file_id, metadata={"k": 5}), 400)["param"] == "metadata"
    assert error_of(http.post("/v1/batches", json={"endpoint": "/v1/completions"}, headers=as_key("key-a")), 400)
    assert error_of(upload(http, ["{}"], purpose="assistants"), 400)["param"] == "purpose"
    assert "limit" in error_of(http.get("/v1/batches?limit=0", headers=as_key("key-a")), 400)["message"]
    output_file = wait_for_end(http, create(http, file_id).json()["id"])["output_file_id"]
    assert error_of(create(http, output_file), 400)["param"] == "input_file_id"


def test_a_key_without_the_batch_tier_cannot_start_a_batch(http):
    file_id = upload(http, [request_line("a", "x")], key="key-interactive").json()["id"]
    assert error_of(create(http, file_id, key="key-interactive"), 403)["code"] == "tier_not_allowed"


def test_tenants_see_only_their_own_files_and_batches(http):
    file_id = upload(http, [request_line("a", "x")], key="key-a").json()["id"]
    batch_id = create(http, file_id, key="key-a").json()["id"]
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{batch_id}"):
        error_of(http.get(path, headers=as_key("key-b")), 404)
        assert http.get(path, headers=as_key("key-a2")).status_code == 200  # same tenant, other key
        assert http.get(path, headers=as_key("key-root")).status_code == 200
    error_of(create(http, file_id, key="key-b"), 404)
    assert http.get("/v1/batches", headers=as_key("key-b")).json()["data"] == []
    assert [b["id"] for b in http.get("/v1/batches", headers=as_key("key-a2")).json()["data"]] == [batch_id]
    error_of(http.post("/v1/files", headers=as_key("nobody")), 401)


def test_read_all_scopes_each_open_one_kind_of_another_tenants_objects(app, http):
    file_id = upload(http, [request_line("a", "x")], key="key-a").json()["id"]
    batch_id = create(http, file_id, key="key-a").json()["id"]
    content = f"/v1/files/{file_id}/content"
    # batches:read-all (the scopes an admin key had): every batch object, but nobody's files, so no prompts.
    assert http.get(f"/v1/batches/{batch_id}", headers=as_key("key-ops")).status_code == 200
    assert [b["id"] for b in http.get("/v1/batches", headers=as_key("key-ops")).json()["data"]] == [batch_id]
    for path in (f"/v1/files/{file_id}", content):
        error_of(http.get(path, headers=as_key("key-ops")), 404)
    assert http.get("/v1/files", headers=as_key("key-ops")).json()["data"] == []
    # files:read-all: every file, each read of another's content on the record first; but no batches.
    assert http.get(content, headers=as_key("key-reader")).text == request_line("a", "x") + "\n"
    assert app.state.gate.audited == [("reader", "files.content", file_id, "acme")]
    assert [f["id"] for f in http.get("/v1/files", headers=as_key("key-reader")).json()["data"]] == [file_id]
    error_of(http.get(f"/v1/batches/{batch_id}", headers=as_key("key-reader")), 404)
    assert http.get("/v1/batches", headers=as_key("key-reader")).json()["data"] == []
    # Reading is all they do: another's batch is not theirs to cancel, nor its file to delete or run.
    error_of(http.post(f"/v1/batches/{batch_id}/cancel", headers=as_key("key-root")), 404)
    error_of(http.delete(f"/v1/files/{file_id}", headers=as_key("key-root")), 404)
    error_of(create(http, file_id, key="key-root"), 404)
    http.get(content, headers=as_key("key-a2"))  # the owner's tenant reads its own: nothing to record
    assert len(app.state.gate.audited) == 1


def test_batches_page_newest_first(http):
    file_id = upload(http, [request_line("a", "x")]).json()["id"]
    ids = [create(http, file_id).json()["id"] for _ in range(3)]
    first = http.get("/v1/batches?limit=2", headers=as_key("key-a")).json()
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = http.get(f"/v1/batches?limit=2&after={first['last_id']}", headers=as_key("key-a")).json()
    assert [b["id"] for b in rest["data"]] == ids[:1] and not rest["has_more"]


def test_the_input_of_an_unfinished_batch_cannot_be_deleted(http):
    file_id = upload(http, [request_line("a", "x")]).json()["id"]
    batch_id = create(http, file_id).json()["id"]
    assert error_of(http.delete(f"/v1/files/{file_id}", headers=as_key("key-a")), 409)["code"] == "file_in_use"
    wait_for_end(http, batch_id)
    assert http.delete(f"/v1/files/{file_id}", headers=as_key("key-a")).json()["deleted"] is True
    error_of(http.get(f"/v1/files/{file_id}", headers=as_key("key-a")), 404)
