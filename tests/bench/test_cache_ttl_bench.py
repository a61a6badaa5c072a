"""`carpool bench cache-ttl` runs end to end at a tiny size and reports its three modes side by side (no timing
asserts: only what the cache did and what was billed)."""

import json

from carpool.cli import main


def test_bench_cache_ttl_reports_no_breakpoint_5m_and_1h(tmp_path):
    out = tmp_path / "cache_ttl.json"
    argv = ["bench", "cache-ttl", "--agents", "1", "--system-tokens", "256", "--turn-tokens", "16"]
    argv += ["--minutes", "40", "--min-gap", "12", "--max-gap", "15", "--num-kv-blocks", "48"]
    argv += ["--pressure-tokens-per-minute", "256", "--pressure-prompt-tokens", "256", "--cache-min-tokens", "256"]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["no breakpoint", "5m", "1h"]
    none, five, hour = modes.values()
    assert none["turns"] == five["turns"] == hour["turns"] >= 2
    # Returns 12-15 minutes apart under pressure: only the 1h pin keeps the system prompt, and is billed for it.
    assert none["prompt_tokens_read_from_cache"] == five["prompt_tokens_read_from_cache"] == 0
    assert hour["prompt_tokens_read_from_cache"] == 256 * (hour["turns"] - 1)
    assert hour["input_cost_per_turn_usd"] < none["input_cost_per_turn_usd"]
    assert five["pins_expired_blocks"] > 0
