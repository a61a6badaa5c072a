"""`--api-key` keys are told apart by their whole secret: two keys sharing a prefix share no cached prefix and
none of each other's files, and no such key is an admin."""

import asyncio
import uuid

import httpx
import pytest

from carpool.engine.async_engine import AsyncEngine
from carpool.server.app import create_app
from carpool.server.open_gate import OpenGate

# Real keys share long prefixes (`sk-proj-`, an organisation's own): these two share their first 12 characters.
FIRST, SECOND = "sk-proj-AAAA" + "x" * 40, "sk-proj-AAAA" + "y" * 40


@pytest.fixture
def app(llm, tmp_path):
    engine = AsyncEngine(engine=llm.engine)
    engine.start()
    yield create_app(engine, OpenGate([FIRST, SECOND]), model_name="tiny", batch_dir=str(tmp_path / "batches"))
    engine.stop()


def as_key(app, key: str, method: str, path: str, **options) -> httpx.Response:
    async def send():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://carpool",
            headers={"Authorization": f"Bearer {key}"},
        ) as client:
            return await client.request(method, path, **options)

    return asyncio.run(send())


def test_each_key_is_its_own_caller_and_none_is_an_admin():
    gate = OpenGate([FIRST, SECOND])
    first, second = gate.authenticate(FIRST), gate.authenticate(SECOND)
    assert first.key_id != second.key_id
    assert not first.scopes and not second.scopes
    assert FIRST not in first.key_id and FIRST[:12] not in first.key_id  # named by a hash, never the secret


def test_a_cached_prefix_is_shared_only_by_the_same_key(app):
    # A prompt no earlier test sent, long enough to fill several cache blocks.
    prompt = f"{uuid.uuid4()} " + "Tell me about the rivers of Europe, one by one, at length. " * 8
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(key):
        response = as_key(app, key, "POST", "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(FIRST) == 0
    assert cached(SECOND) == 0  # not the first key's blocks, though its key starts the same
    assert cached(FIRST) > 0  # the first key's own second request does reuse them
    body["cache_salt"] = "shared-salt"  # a salt narrows a key's cache; it never opens another key's
    assert cached(FIRST) == 0
    assert cached(SECOND) == 0
    assert cached(FIRST) > 0


def test_files_are_private_to_the_key_that_uploaded_them(app):
    uploaded = as_key(
        app,
        FIRST,
        "POST",
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("mine.jsonl", b'{"custom_id": "a"}\n')},
    )
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    assert [f["id"] for f in as_key(app, FIRST, "GET", "/v1/files").json()["data"]] == [file_id]
    assert as_key(app, SECOND, "GET", "/v1/files").json()["data"] == []
    for method, path in (
        ("GET", f"/v1/files/{file_id}"),
        ("GET", f"/v1/files/{file_id}/content"),
        ("DELETE", f"/v1/files/{file_id}"),
    ):
        assert as_key(app, SECOND, method, path).status_code == 404
    assert as_key(app, FIRST, "GET", f"/v1/files/{file_id}").status_code == 200


def with_headers(app, headers: list[tuple[str, str]]) -> httpx.Response:
    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            return await client.get("/v1/models", headers=httpx.Headers(headers))

    return asyncio.run(send())


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", "Bearer sk-wrong"), ("Authorization", f"Bearer {FIRST}")],
        [("Authorization", f"Bearer {FIRST}"), ("Authorization", f"Bearer {FIRST}")],
        [("Authorization", f"Bearer {FIRST}"), ("x-api-key", SECOND)],
        [("x-api-key", FIRST), ("x-api-key", SECOND)],
    ],
)
def test_a_request_with_several_credentials_is_a_400(app, headers):
    refused = with_headers(app, headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "multiple_credentials"


def test_one_credential_by_either_header_is_accepted(app):
    for headers in (
        [("Authorization", f"Bearer {FIRST}")],
        [("x-api-key", FIRST)],
        [("Authorization", f"Bearer {FIRST}"), ("x-api-key", FIRST)],  # the same key twice is one credential
    ):
        assert with_headers(app, headers).status_code == 200, headers
    assert with_headers(app, [("x-api-key", "sk-wrong")]).status_code == 401
