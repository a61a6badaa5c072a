"""Cache breakpoints' TTL pins on a real engine, timed by an injected clock (no sleeps): a pinned prefix outlives
memory pressure that evicts an unpinned one, lapses after its TTL without a hit, is renewed by a hit, and a pin
past the bound is refused while the request is still served and billed as an ordinary write."""

import pytest
from block_invariants import check_block_invariants, check_idle

from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.request import CacheBreakpoint
from carpool.engine.sampling_params import SamplingParams

BLOCK = 16
PREFIX = 8 * BLOCK  # the pinned prefix: 8 full blocks
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
FIVE_MINUTES, ONE_HOUR = 300.0, 3600.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock():
    return Clock()


@pytest.fixture(scope="module")
def engine(clock):
    """64 blocks (1,024 tokens) of which half may be pinned: max_model_len 512 leaves room for any request."""
    config = EngineConfig(
        num_kv_blocks=64, block_size=BLOCK, max_model_len=512, cache_pin_fraction=0.5, cache_min_tokens=PREFIX
    )
    return LLMEngine(config, clock=clock)


@pytest.fixture(autouse=True)
def no_pins_left(engine, clock):
    """Each test starts and ends with every pin lapsed and every block free."""
    clock.now += 10 * ONE_HOUR
    engine.block_manager.expire_pins()
    yield
    check_idle(engine)
    clock.now += 10 * ONE_HOUR
    engine.block_manager.expire_pins()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


_ids = iter(range(10**6))


def prompt(seed: int, length: int = PREFIX + 5) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(length)]


def run(engine, token_ids, salt, breakpoints=()):
    """One request to its end, the block invariants checked after every step; its last output."""
    request_id = f"r{next(_ids)}"
    engine.add_request(request_id, token_ids, ONE_TOKEN, cache_salt=salt, cache_breakpoints=breakpoints)
    last = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                last = output
        check_block_invariants(engine)
    return last


def pressure(engine, rounds: int = 6):
    """Other tenants' distinct prompts, more KV than the pool holds: every unpinned cached block is evicted."""
    for _ in range(rounds):
        run(engine, prompt(next(_ids) + 1000, 200), salt="others")


def test_one_hour_prefix_survives_pressure_that_evicts_an_unpinned_one(engine, clock):
    pinned = run(engine, prompt(1), "a", (CacheBreakpoint(PREFIX, ONE_HOUR),))
    assert pinned.cache_write_tokens_by_ttl == {ONE_HOUR: PREFIX} and pinned.num_cache_write_tokens == 0
    unpinned = run(engine, prompt(2), "b")
    assert unpinned.num_cache_write_tokens == PREFIX and not unpinned.cache_write_tokens_by_ttl
    clock.now += 30 * 60
    pressure(engine)
    assert run(engine, prompt(1), "a").num_cached_tokens == PREFIX  # read, although it came with no breakpoint
    assert run(engine, prompt(2), "b").num_cached_tokens == 0
    stats = engine.block_manager.pin_stats
    assert stats.pinned_blocks[ONE_HOUR] == PREFIX // BLOCK


def test_pin_lapses_after_its_ttl_without_a_hit(engine, clock):
    expired_before = engine.block_manager.pin_stats.expired_blocks[ONE_HOUR]
    run(engine, prompt(3), "a", (CacheBreakpoint(PREFIX, ONE_HOUR),))
    clock.now += ONE_HOUR
    pressure(engine)
    assert run(engine, prompt(3), "a").num_cached_tokens == 0
    assert engine.block_manager.pin_stats.expired_blocks[ONE_HOUR] - expired_before == PREFIX // BLOCK


def test_a_hit_renews_the_pin(engine, clock):
    run(engine, prompt(4), "a", (CacheBreakpoint(PREFIX, ONE_HOUR),))
    hits_before = engine.block_manager.pin_stats.hits
    clock.now += 50 * 60
    assert run(engine, prompt(4) + [7], "a").num_cached_tokens == PREFIX  # a hit at 50 min: pinned until 110
    assert engine.block_manager.pin_stats.hits == hits_before + 1
    clock.now += 50 * 60  # 100 min: past the first hour, inside the renewed one
    pressure(engine)
    assert len(engine.block_manager.pinned) == PREFIX // BLOCK
    clock.now += 10 * 60 + 1  # 111 min: the renewed hour is over
    pressure(engine)
    assert not engine.block_manager.pinned
    assert run(engine, prompt(4), "a").num_cached_tokens == 0


def test_five_minute_prefix_lapses_at_five_minutes(engine, clock):
    run(engine, prompt(5), "a", (CacheBreakpoint(PREFIX, FIVE_MINUTES),))
    clock.now += FIVE_MINUTES - 1
    pressure(engine)
    assert len(engine.block_manager.pinned) == PREFIX // BLOCK
    clock.now += 1
    pressure(engine)
    assert not engine.block_manager.pinned
    assert run(engine, prompt(5), "a").num_cached_tokens == 0


def test_pin_past_the_bound_is_refused_and_the_request_served_as_an_ordinary_write(engine, clock):
    manager = engine.block_manager
    bound, refused_before = manager.max_pinned_blocks, manager.pin_stats.refused
    manager.max_pinned_blocks = PREFIX // BLOCK + 2  # room for one prefix, not two
    try:
        run(engine, prompt(6), "a", (CacheBreakpoint(PREFIX, ONE_HOUR),))
        refused = run(engine, prompt(7), "b", (CacheBreakpoint(PREFIX, ONE_HOUR),))
    finally:
        manager.max_pinned_blocks = bound
    assert refused.finished and refused.finish_reason == "length"
    assert refused.cache_write_tokens_by_ttl == {} and refused.num_cache_write_tokens == PREFIX
    assert manager.pin_stats.refused == refused_before + 1
    assert len(manager.pinned) == PREFIX // BLOCK  # the first prefix's pins only
    pressure(engine)
    assert run(engine, prompt(7), "b").num_cached_tokens == 0  # cached as an ordinary LRU prefix: evicted


def test_breakpoints_below_the_minimum_are_not_pinned_nor_billed_as_ttl_writes(engine):
    short = run(engine, prompt(8), "a", (CacheBreakpoint(PREFIX - BLOCK, ONE_HOUR),))
    assert short.cache_write_tokens_by_ttl == {} and short.num_cache_write_tokens == PREFIX
    assert not engine.block_manager.pinned


def test_ttls_by_segment_and_writes_only_for_what_the_request_computed(engine):
    """Two breakpoints: blocks up to the first keep its (longer) TTL, the rest the second's. A second request that
    reads the prefix writes nothing under a TTL: its hit is a read."""
    points = (CacheBreakpoint(PREFIX, ONE_HOUR), CacheBreakpoint(PREFIX + 4 * BLOCK, FIVE_MINUTES))
    first = run(engine, prompt(9, PREFIX + 4 * BLOCK + 3), "a", points)
    assert first.cache_write_tokens_by_ttl == {ONE_HOUR: PREFIX, FIVE_MINUTES: 4 * BLOCK}
    pins = engine.block_manager.pin_stats.pinned_blocks
    assert (pins[ONE_HOUR], pins[FIVE_MINUTES]) == (PREFIX // BLOCK, 4)
    again = run(engine, prompt(9, PREFIX + 4 * BLOCK + 3), "a", points)
    assert again.num_cached_tokens == PREFIX + 4 * BLOCK and again.cache_write_tokens_by_ttl == {}


@pytest.mark.parametrize(
    "points, message",
    [
        ([CacheBreakpoint(PREFIX * (i + 1), ONE_HOUR) for i in range(5)], "at most 4"),
        ((CacheBreakpoint(PREFIX, ONE_HOUR), CacheBreakpoint(PREFIX - 1, ONE_HOUR)), "must ascend"),
        ((CacheBreakpoint(PREFIX, FIVE_MINUTES), CacheBreakpoint(PREFIX + 1, ONE_HOUR)), "longer TTL"),
        ((CacheBreakpoint(PREFIX + 6, ONE_HOUR),), "within the prompt"),
        ((CacheBreakpoint(0, ONE_HOUR),), "within the prompt"),
        ((CacheBreakpoint(PREFIX, 0),), "ttl_seconds"),
        ((CacheBreakpoint(PREFIX, float("nan")),), "ttl_seconds"),
        (((PREFIX, ONE_HOUR),), "CacheBreakpoint"),
    ],
)
def test_bad_breakpoints_are_refused_at_the_door(engine, points, message):
    with pytest.raises(ValueError, match="cache_breakpoints") as error:
        engine.request("bad", prompt(10), ONE_TOKEN, cache_breakpoints=points)
    assert message in str(error.value)
    assert not engine.has_unfinished_requests()
