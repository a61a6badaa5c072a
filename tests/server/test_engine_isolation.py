"""One engine's failure does not stop every model: two models share one engine loop (as `carpool serve` runs
them); when one's step raises, its requests fail and its name is a 503, while the other keeps serving and
/health names the one that failed."""

import asyncio

import httpx
import pytest

from carpool.engine.async_engine import AsyncEngine, EngineLoop
from carpool.engine.config import EngineConfig
from carpool.server.app import create_app

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def send(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def one():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://carpool", timeout=60
        ) as client:
            return await client.request(method, path, json=body)

    return asyncio.run(one())


@pytest.fixture
def two_models():
    loop = EngineLoop()
    engines = {
        name: AsyncEngine(EngineConfig(max_num_seqs=2, num_kv_blocks=32), engine_loop=loop) for name in ("a", "b")
    }
    loop.start()
    yield engines
    loop.stop()


def test_a_failing_engine_leaves_the_other_models_serving(two_models):
    app = create_app(two_models)
    assert send(app, "POST", CHAT, BODY | {"model": "b"}).status_code == 200

    def broken_step():
        raise RuntimeError("a kernel fault")

    two_models["a"].engine.step = broken_step
    failed = send(app, "POST", CHAT, BODY | {"model": "a"})
    assert failed.status_code == 500 and "a kernel fault" in failed.text  # the request it was running fails
    refused = send(app, "POST", CHAT, BODY | {"model": "a"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_unavailable"
    for _ in range(2):  # the loop went on: the other model still answers
        assert send(app, "POST", CHAT, BODY | {"model": "b"}).status_code == 200
    health = send(app, "GET", "/health")
    assert health.status_code == 200, health.text
    assert health.json()["status"] == "degraded" and list(health.json()["failed"]) == ["a"]
    assert "a kernel fault" in health.json()["failed"]["a"]
