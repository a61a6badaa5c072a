"""Real `carpool serve` processes on free local ports, shared by the whole session: one with the default engine
(and API keys), one small one (two sequence slots, short queues) for the tier and admission tests; and an
in-process AsyncEngine over the session's model for tests that build their own app."""

from collections import namedtuple

import pytest
from live_server import LiveServer

from carpool.economics.db import open_database
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.engine.async_engine import AsyncEngine
from carpool.server.app import create_app

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


@pytest.fixture(scope="module")
def two_models_two_keys(request, tmp_path_factory):
    """A server of SmolLM2 and Qwen2.5-Coder 0.5B (whose template has tools) with two keys, the module's KEY and
    OTHER_KEY (a second tenant), for the API tests of one module."""
    module = request.module
    models = ("--model", "smollm2-135m", "--model", "qwen2.5-coder-0.5b", "--max-num-seqs", "4")
    home = str(tmp_path_factory.mktemp("home"))
    live = LiveServer(*models, "--api-key", module.OTHER_KEY, api_key=module.KEY, home=home)
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


@pytest.fixture(scope="module")
def strong_engine():
    """A second engine of the session's model (exact fp32): the "strong" model of the cascade and router tests."""
    from carpool import LLM

    engine = AsyncEngine(engine=LLM(max_num_seqs=4, num_kv_blocks=64, dtype="float32", matmul="exact").engine)
    engine.start()
    yield engine
    engine.stop()


LedgerApp = namedtuple("LedgerApp", "app gate conn")


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_app(engine, tmp_path, request):
    """An in-process app (its model served as "tiny") over a ledger on each store, with a connection to it."""
    db = request.getfixturevalue("postgres_url") if request.param == "postgresql" else str(tmp_path / "carpool.db")
    gate = LedgerGate(db, load_price_sheet(None))
    conn = open_database(db)
    yield LedgerApp(create_app(engine, gate, model_name="tiny"), gate, conn)
    conn.close()
    gate.close()
