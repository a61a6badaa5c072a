"""Real `carpool serve` processes on free local ports, shared by the whole session: one with the default engine
(and API keys), one small one (two sequence slots, short queues) for the tier and admission tests; and an
in-process AsyncEngine over the session's model for tests that build their own app."""

import pytest
from live_server import LiveServer

from carpool.engine.async_engine import AsyncEngine

API_KEY = "sk-carpool-test"


@pytest.fixture(scope="session")
def server():
    live = LiveServer(api_key=API_KEY)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def small_server():
    live = LiveServer("--max-num-seqs", "2", "--max-queued-per-tier", "4")
    yield live
    live.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture
def engine(llm):
    engine = AsyncEngine(engine=llm.engine)
    engine.start()
    yield engine
    engine.stop()
