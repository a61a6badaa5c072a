"""The usage report, mounted as `carpool serve` mounts it: behind the server's authentication and error bodies."""

import pytest
from economics_helpers import usage
from fastapi import FastAPI
from fastapi.testclient import TestClient

from carpool.economics.db import connect
from carpool.economics.keys import ADMIN_SCOPES, create_key
from carpool.economics.routes import usage_router
from carpool.server.auth import Authenticate, request_principal
from carpool.server.errors import install_error_handlers


@pytest.fixture
def client(gate):
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(Authenticate, gate=gate)
    app.include_router(usage_router(gate, caller=request_principal))
    return TestClient(app)


def test_open_server_serves_the_report(client, gate):
    gate.record(gate.authenticate(None), usage())
    response = client.get("/v1/usage", params={"group_by": "tier"})
    assert response.status_code == 200
    body = response.json()
    assert body["group_by"] == "tier" and body["data"][0]["group"] == "default"
    assert body["data"][0]["cost"] == pytest.approx(0.0018)


def test_admin_key_required(client, gate, db_path):
    with connect(db_path) as conn:
        _, user = create_key(conn, "acme")
        _, admin = create_key(conn, "ops", scopes=ADMIN_SCOPES)
    gate.record(gate.authenticate(user), usage())

    missing = client.get("/v1/usage")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert missing.json()["error"]["type"] == "authentication_error"  # the server's 401, not one of its own
    forbidden = client.get("/v1/usage", headers={"Authorization": f"Bearer {user}"})
    assert forbidden.status_code == 403
    assert forbidden.json()["error"] == {
        "message": "The usage report needs a key with the usage:read scope.",
        "type": "permission_error",
        "param": None,
        "code": "admin_key_required",
    }
    ok = client.get("/v1/usage", headers={"Authorization": f"Bearer {admin}"}, params={"start": "2000-01-01"})
    assert ok.status_code == 200 and [row["group"] for row in ok.json()["data"]] == ["acme"]


@pytest.mark.parametrize("params, param", [({"group_by": "user"}, "group_by"), ({"end": "soon"}, "end")])
def test_bad_parameters_are_400(client, params, param):
    response = client.get("/v1/usage", params=params)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["type"] == "invalid_request_error"
