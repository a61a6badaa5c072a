import pytest

from carpool.economics.db import connect
from carpool.economics.rate_limit import RateLimiter, RateLimitExceeded
from carpool.economics.spend import SpendTracker, period_start

JUNE_15_NOON = 1_749_988_800.0  # 2025-06-15 12:00:00 UTC


def test_period_start_is_utc_day_and_month():
    assert period_start("day", JUNE_15_NOON) == 1_749_945_600.0  # 2025-06-15 00:00 UTC
    assert period_start("month", JUNE_15_NOON) == 1_748_736_000.0  # 2025-06-01 00:00 UTC
    with pytest.raises(ValueError):
        period_start("week", JUNE_15_NOON)


def test_spend_tracker_seeds_from_ledger_and_rolls_over(db_path):
    conn = connect(db_path)
    with conn:
        conn.executemany(
            "INSERT INTO ledger (time, key_id, model, tier, uncached_prompt_tokens, cache_read_tokens,"
            " cache_write_tokens, output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost)"
            " VALUES (?, ?, 'm', 'default', 0, 0, 0, 0, 0, 0, 0, 'stop', ?)",
            [
                (JUNE_15_NOON - 3600, "k", 1.0),  # today
                (JUNE_15_NOON - 86400, "k", 2.0),  # yesterday, this month
                (JUNE_15_NOON - 40 * 86400, "k", 4.0),  # last month
                (JUNE_15_NOON - 60, "other", 8.0),
            ],
        )
    tracker = SpendTracker(conn, JUNE_15_NOON)
    assert tracker.spent("k", "day", JUNE_15_NOON) == 1.0
    assert tracker.spent("k", "month", JUNE_15_NOON) == 3.0
    tracker.add("k", 0.5, JUNE_15_NOON + 1)
    assert tracker.spent("k", "day", JUNE_15_NOON + 2) == 1.5
    tomorrow = JUNE_15_NOON + 86400
    assert tracker.spent("k", "day", tomorrow) == 0.0
    assert tracker.spent("k", "month", tomorrow) == 3.5
    tracker.add("k", 100.0, JUNE_15_NOON)  # finished before midnight, recorded after: yesterday is closed
    assert tracker.spent("k", "day", tomorrow) == 0.0


def test_requests_per_minute_window_and_retry_after():
    limiter = RateLimiter()
    for t in (0.0, 10.0, 20.0):
        limiter.admit("k", 1, rpm=3, tpm=None, now=t)
    with pytest.raises(RateLimitExceeded) as raised:
        limiter.admit("k", 1, rpm=3, tpm=None, now=30.0)
    assert raised.value.retry_after == pytest.approx(30.0)  # the admission at 0 leaves at 60
    limiter.admit("k", 1, rpm=3, tpm=None, now=60.0)
    limiter.admit("other", 1, rpm=3, tpm=None, now=30.0)  # limits are per key


def test_tokens_per_minute_waits_for_enough_tokens_to_leave():
    limiter = RateLimiter()
    limiter.admit("k", 400, rpm=None, tpm=1000, now=0.0)
    limiter.admit("k", 300, rpm=None, tpm=1000, now=5.0)
    limiter.admit("k", 200, rpm=None, tpm=1000, now=8.0)
    with pytest.raises(RateLimitExceeded) as raised:
        limiter.admit("k", 500, rpm=None, tpm=1000, now=9.0)  # 900 used: 400 must leave (at 60)
    assert raised.value.retry_after == pytest.approx(51.0)
    with pytest.raises(RateLimitExceeded) as raised:
        limiter.admit("k", 800, rpm=None, tpm=1000, now=9.0)  # 400 and 300 must leave (at 65)
    assert raised.value.retry_after == pytest.approx(56.0)
    limiter.admit("k", 500, rpm=None, tpm=1000, now=60.0)


def test_refused_requests_do_not_count_and_oversized_ones_never_fit():
    limiter = RateLimiter()
    limiter.admit("k", 10, rpm=1, tpm=None, now=0.0)
    for _ in range(5):
        with pytest.raises(RateLimitExceeded):
            limiter.admit("k", 10, rpm=1, tpm=None, now=1.0)
    limiter.admit("k", 10, rpm=1, tpm=None, now=60.0)
    with pytest.raises(RateLimitExceeded) as raised:
        limiter.admit("k", 2000, rpm=None, tpm=1000, now=0.0)
    assert raised.value.retry_after is None
