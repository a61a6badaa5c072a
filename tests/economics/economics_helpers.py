"""Shared test data for the economics tests: a price sheet with round prices, usage records, fixed measurements.

The test folders have no __init__.py, so pytest puts each on sys.path and imports this by its bare name: the
name must stay unique across all test folders.
"""

import itertools
import time

from carpool.economics.contract import UsageRecord
from carpool.economics.footprint import ModelFootprint
from carpool.economics.hardware import Hardware
from carpool.economics.phase_meter import PhaseTotals

# The shipped multipliers, round model prices: every expected cost in these tests is worked out by hand.
TEST_SHEET = """
[cache]
read = 0.1
write = 1.25

[tiers]
priority = 2.0
default = 1.0
flex = 0.5
batch = 0.5

[models."test-model"]
input = 1.0
output = 4.0
"""


class Clock:
    """A clock the test moves by hand; it starts at the real time, which usage records are stamped with."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


_REQUEST_NUMBERS = itertools.count()


def usage(
    prompt=1000, cached=0, cache_write=0, output=200, tier="default", finish_reason="stop", created=None, **extra
) -> UsageRecord:
    fields = {
        "request_id": f"req_{next(_REQUEST_NUMBERS)}",  # unique: the ledger bills one row per request id
        "model": "test-model",
        "tier": tier,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_write_tokens": cache_write,
        "output_tokens": output,
        "queue_seconds": 0.01,
        "prefill_seconds": 0.2,
        "decode_seconds": 0.8,
        "finish_reason": finish_reason,
    }
    if created is not None:
        fields["created"] = created
    return UsageRecord(**(fields | extra))


# 100k prompt tokens in 10 s of prefill; 20k output tokens in 40 s of decode, of which 1000 decode-only steps
# took 30 s with 16 sequences each at a mean context of 500 tokens.
PHASES = PhaseTotals(
    prefill_tokens=100_000,
    prefill_seconds=10.0,
    decode_tokens=20_000,
    decode_seconds=40.0,
    decode_steps=1000,
    decode_step_seconds=30.0,
    decode_step_sequences=16_000,
    decode_step_context_tokens=8_000_000,
)
HARDWARE = Hardware(device="test", memory_bandwidth=1e11, flops=1e12)  # 100 GB/s, 1 TFLOP/s
FOOTPRINT = ModelFootprint(
    name="test-model",
    parameters=100_000_000,
    matmul_parameters=100_000_000,
    streamed_bytes_per_step=400_000_000,
    kv_bytes_per_token=40_000,
    attention_flops_per_context_token=50_000,
)
