"""What the server shows without a key, and the small promises of its HTTP surface: the docs close when keys are
required, every response carries x-request-id, /openapi.json documents 400s, a limit is named when broken, and
an uploaded file's name loses its folders."""

import asyncio

import httpx
import openai

from carpool.cli import build_parser
from carpool.server.app import create_app
from carpool.server.open_gate import OpenGate

KEY = "sk-carpool-surface"
DOCS = ("/docs", "/redoc", "/openapi.json")


def send(app, method: str, path: str, key: str | None = KEY, **options) -> httpx.Response:
    headers = options.pop("headers", {}) | ({"Authorization": f"Bearer {key}"} if key else {})

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            return await client.request(method, path, headers=headers, **options)

    return asyncio.run(go())


def test_the_docs_need_a_key_when_the_api_does(engine):
    keyed = create_app(engine, OpenGate([KEY]), model_name="tiny")
    for path in DOCS:
        assert send(keyed, "GET", path, key=None).status_code == 401, path
        assert send(keyed, "GET", path).status_code == 200, path
    open_app = create_app(engine, OpenGate(), model_name="tiny")
    assert all(send(open_app, "GET", path, key=None).status_code == 200 for path in DOCS)


def test_tenant_metrics_are_opt_in():
    assert build_parser().parse_args(["serve"]).metrics_tenants is False
    assert build_parser().parse_args(["serve", "--metrics-tenants"]).metrics_tenants is True


def test_every_response_carries_a_request_id(engine):
    app = create_app(engine, OpenGate([KEY]), model_name="tiny")
    responses = [
        send(app, "GET", "/health", key=None),
        send(app, "GET", "/v1/models", key="sk-wrong"),  # refused before anything else runs
        send(app, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": "two"}),
        send(app, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}),
    ]
    ids = [response.headers.get("x-request-id") for response in responses]
    assert all(ids) and len(set(ids)) == len(ids), ids
    assert [r.status_code for r in responses] == [200, 401, 400, 200]
    mine = send(app, "GET", "/v1/models", headers={"x-request-id": "trace-42:abc"})
    assert mine.headers["x-request-id"] == "trace-42:abc"  # the client's own id, so logs on both sides meet
    forged = send(app, "GET", "/v1/models", headers={"x-request-id": "x" * 500})
    assert forged.headers["x-request-id"].startswith("req_")


def test_the_sdk_sees_the_request_id(engine):
    app = create_app(engine, OpenGate([KEY]), model_name="tiny")

    async def complete():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(base_url="http://carpool/v1", api_key=KEY, http_client=http, max_retries=0)
        async with http:
            return await client.completions.create(model="tiny", prompt="Hi", max_tokens=1)

    assert asyncio.run(complete())._request_id.startswith("req_")


def test_openapi_documents_400_not_422(engine):
    schema = send(create_app(engine, OpenGate(), model_name="tiny"), "GET", "/openapi.json").json()
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses
    assert '"422"' not in str(schema).replace("'", '"')
    assert "Error" in schema["components"]["schemas"]


def test_too_many_stop_strings_name_the_limit(engine):
    app = create_app(engine, OpenGate(), model_name="tiny")
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": ["a", "b", "c", "d", "e"]}
    response = send(app, "POST", "/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "stop"
    assert "at most 4" in error["message"] and "valid string" not in error["message"]


def test_an_uploaded_files_folders_are_dropped(engine, tmp_path):
    app = create_app(engine, OpenGate(), model_name="tiny", batch_dir=str(tmp_path))
    for sent in ("../../etc/evil.jsonl", "..\\..\\evil.jsonl", "/abs/evil.jsonl"):
        uploaded = send(app, "POST", "/v1/files", data={"purpose": "batch"}, files={"file": (sent, b"{}\n")}).json()
        assert uploaded["filename"] == "evil.jsonl", sent
        content = send(app, "GET", f"/v1/files/{uploaded['id']}/content")
        disposition = content.headers["content-disposition"]
        assert "evil.jsonl" in disposition and ".." not in disposition and "/" not in disposition
