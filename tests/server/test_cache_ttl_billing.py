"""Prompt-cache TTL writes billed from the ledger, exactly: a request with cache breakpoints runs on a real engine,
its Generation hands the UsageRecord to a real LedgerGate, and the row's cost is worked out by hand (input $1/M,
output $4/M: 5m writes 1.25x, 1h writes 2x, reads 0.1x, the batch tier's 0.5 on top)."""

import asyncio
import sqlite3

import pytest

from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.request import CacheBreakpoint
from carpool.engine.sampling_params import SamplingParams
from carpool.server.admission import TierQueues
from carpool.server.generation import Backends, Choice, Generation
from carpool.server.metrics import ServerMetrics

SHEET = """
[cache]
read = 0.1
write = 1.25
write_1h = 2.0
min_tokens = 256

[tiers]
batch = 0.5

[models."m"]
input = 1.0
output = 4.0
"""
BLOCK = 16
PREFIX = 17 * BLOCK  # 272 tokens: above the sheet's minimum of 256
PROMPT = PREFIX + 3  # the last 3 tokens fill no block: never cached, always fresh input
FIVE_MINUTES, ONE_HOUR = 300.0, 3600.0
MILLION = 1_000_000


@pytest.fixture(scope="module")
def prices(tmp_path_factory):
    path = tmp_path_factory.mktemp("sheet") / "prices.toml"
    path.write_text(SHEET)
    return load_price_sheet(path)


@pytest.fixture(scope="module")
def engine(prices):
    config = EngineConfig(
        num_kv_blocks=128,
        block_size=BLOCK,
        max_model_len=1024,
        cache_pin_fraction=0.5,
        cache_min_tokens=prices.cache_min_tokens,  # as `carpool serve` sets it from the sheet
    )
    engine = AsyncEngine(engine=LLMEngine(config))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def ledger(tmp_path, prices):
    db = tmp_path / "carpool.db"
    gate = LedgerGate(db, prices)
    yield gate, db
    gate.close()


_seeds = iter(range(1, 10**6))


def fresh_prompt() -> list[int]:
    seed = next(_seeds)
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(PROMPT)]


def bill(engine, ledger, token_ids, breakpoints=(), tier="default", automatic_writes=True) -> sqlite3.Row:
    """Serve one request through a Generation (the server's path to the gate) and return its ledger row."""
    gate, db = ledger

    async def serve():
        request = engine.door.request(
            f"r{next(_seeds)}",
            token_ids,
            SamplingParams(max_tokens=1, temperature=0),
            tier,
            cache_salt="tenant",
            cache_breakpoints=breakpoints,
        )
        queues = TierQueues(4)
        queues.reserve(tier, 1)
        backends = Backends(engine, gate, ServerMetrics(["m"]).models["m"], queues, "m")
        choice = Choice(0, request, bills_prompt=True)
        generation = Generation(backends, request.request_id, tier, gate.authenticate(None), [choice], False)
        generation.bills_automatic_writes = automatic_writes
        await generation.wait()

    asyncio.run(serve())
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    return conn.execute("SELECT * FROM ledger ORDER BY id DESC LIMIT 1").fetchone()


def tokens(row) -> tuple:
    return (
        row["uncached_prompt_tokens"],
        row["cache_read_tokens"],
        row["cache_write_tokens"],
        row["cache_write_5m_tokens"],
        row["cache_write_1h_tokens"],
    )


OUTPUT = 1 * 4.0 / MILLION  # one output token


def test_five_minute_write_costs_one_and_a_quarter_input(engine, ledger):
    row = bill(engine, ledger, fresh_prompt(), (CacheBreakpoint(PREFIX, FIVE_MINUTES),))
    assert tokens(row) == (PROMPT, 0, 0, PREFIX, 0)
    assert row["cost"] == pytest.approx((3 + PREFIX * 1.25) / MILLION + OUTPUT, rel=1e-12)


def test_one_hour_write_costs_twice_input_and_a_read_a_tenth(engine, ledger):
    prompt = fresh_prompt()
    row = bill(engine, ledger, prompt, (CacheBreakpoint(PREFIX, ONE_HOUR),))
    assert tokens(row) == (PROMPT, 0, 0, 0, PREFIX)
    assert row["cost"] == pytest.approx((3 + PREFIX * 2.0) / MILLION + OUTPUT, rel=1e-12)
    hits = engine.snapshot().pins.hits
    read = bill(engine, ledger, prompt, (CacheBreakpoint(PREFIX, ONE_HOUR),))
    assert tokens(read) == (3, PREFIX, 0, 0, 0)
    assert read["cost"] == pytest.approx((3 + PREFIX * 0.1) / MILLION + OUTPUT, rel=1e-12)
    pins = engine.snapshot().pins  # what /metrics reads: the read renewed the pinned prefix
    assert pins.hits == hits + 1 and pins.pinned_blocks[ONE_HOUR] >= PREFIX // BLOCK


def test_a_prefix_below_the_minimum_is_not_billed_as_a_ttl_write(engine, ledger):
    """Its blocks are cached as any prompt's are: an automatic write (1.25x), never the 1h premium."""
    row = bill(engine, ledger, fresh_prompt(), (CacheBreakpoint(PREFIX - 2 * BLOCK, ONE_HOUR),))
    assert tokens(row) == (PROMPT, 0, PREFIX, 0, 0)
    assert row["cost"] == pytest.approx((3 + PREFIX * 1.25) / MILLION + OUTPUT, rel=1e-12)


def test_on_anthropics_route_a_prefix_below_the_minimum_is_plain_input(engine, ledger):
    """The Messages API writes only what a breakpoint pins: a breakpoint below the minimum writes nothing billed."""
    row = bill(engine, ledger, fresh_prompt(), (CacheBreakpoint(PREFIX - 2 * BLOCK, ONE_HOUR),), automatic_writes=False)
    assert tokens(row) == (PROMPT, 0, 0, 0, 0)
    assert row["cost"] == pytest.approx(PROMPT / MILLION + OUTPUT, rel=1e-12)


def test_a_pin_past_the_bound_is_billed_as_an_ordinary_write(engine, ledger):
    manager = engine.engine.block_manager
    bound, manager.max_pinned_blocks = manager.max_pinned_blocks, 0
    try:
        row = bill(engine, ledger, fresh_prompt(), (CacheBreakpoint(PREFIX, ONE_HOUR),))
    finally:
        manager.max_pinned_blocks = bound
    assert tokens(row) == (PROMPT, 0, PREFIX, 0, 0)
    assert row["cost"] == pytest.approx((3 + PREFIX * 1.25) / MILLION + OUTPUT, rel=1e-12)


def test_the_batch_tier_discount_stacks_with_cache_prices(engine, ledger):
    prompt = fresh_prompt()
    write = bill(engine, ledger, prompt, (CacheBreakpoint(PREFIX, ONE_HOUR),), tier="batch")
    assert tokens(write) == (PROMPT, 0, 0, 0, PREFIX)
    assert write["cost"] == pytest.approx(((3 + PREFIX * 2.0) / MILLION + OUTPUT) * 0.5, rel=1e-12)
    read = bill(engine, ledger, prompt, tier="batch")
    assert tokens(read) == (3, PREFIX, 0, 0, 0)
    assert read["cost"] == pytest.approx(((3 + PREFIX * 0.1) / MILLION + OUTPUT) * 0.5, rel=1e-12)
