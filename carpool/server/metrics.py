"""Prometheus metrics under vLLM's names with a `carpool:` prefix, so existing vLLM dashboards port over.

Every series carries the served model's name (`model_name`, as vLLM's do), so one server's models read apart;
per-request series also carry the service tier. Per-step series (batch sizes, inter-token gaps, preemptions)
are observed on the engine thread by a step listener, where every step's exact timing is known.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from carpool.engine.async_engine import EngineSnapshot
from carpool.engine.block_manager import PinStats
from carpool.engine.llm_engine import StepStats
from carpool.engine.outputs import RequestOutput
from carpool.engine.tiers import TIER_NAMES

FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets, so quantiles compare across the two servers.
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPTED_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 16)


class ServerMetrics:
    """The server's registry, with one `Metrics` per served model (`models[name]`)."""

    def __init__(self, model_names: list[str]):
        self.registry = CollectorRegistry()
        tiered = ["model_name", "tier"]
        model = ["model_name"]

        def histogram(name, doc, labels, buckets):
            return Histogram(f"carpool:{name}", doc, labels, buckets=buckets, registry=self.registry)

        def counter(name, doc, labels):
            return Counter(f"carpool:{name}", doc, labels, registry=self.registry)

        def gauge(name, doc, labels=model):
            return Gauge(f"carpool:{name}", doc, labels, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", tiered, LATENCY_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens of a request.", model, ITL_BUCKETS
        )
        # The same gaps by tier, as the server hands the tokens on (it knows each request's tier; the engine thread
        # that observes the series above does not).
        self.itl_by_tier = histogram(
            "inter_token_latency_by_tier_seconds",
            "Gap between consecutive tokens of a request, by service tier.",
            tiered,
            ITL_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", tiered, REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", tiered, REQUEST_BUCKETS)
        self.prefill = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", tiered, REQUEST_BUCKETS
        )
        self.decode = histogram("request_decode_time_seconds", "First token to last token.", tiered, REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens", "Tokens per engine step.", model, TOKEN_BUCKETS)
        self.iteration_seqs = histogram("iteration_seqs", "Sequences per engine step.", model, SEQ_BUCKETS)
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests that reached their first token.", tiered
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.", tiered)
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", tiered + ["finished_reason"]
        )
        self.preemptions = counter("num_preemptions", "Sequences preempted (to be recomputed).", model)
        self.structured_requests = counter(
            "structured_requests",
            "Requests whose output a grammar constrains, by kind (json, json_object, regex, choice, grammar, tools).",
            ["model_name", "kind"],
        )
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        # The limits the latest step ran under: --max-num-batched-tokens / --max-num-seqs, or the SLO controller's
        # choice (carpool.engine.slo), with why as labels on a 1 (reason fixed, throughput, itl or ttft; tier).
        self.step_token_budget = gauge("step_token_budget", "Token budget of the latest engine step.")
        self.step_max_seqs = gauge("step_max_seqs", "Sequence cap (admissions) of the latest engine step.")
        self.step_budget_reason = gauge(
            "step_budget_reason",
            "Why the latest step had its budget (value 1; the reason and tier it had before read 0).",
            ["model_name", "reason", "tier"],
        )
        # The SLO controller's closed loop: the factor on its open-loop step-time target, and what it measures.
        self.step_target_factor = gauge(
            "step_target_factor",
            "Factor the SLO controller scales its step-time "
            "target by so the measured ITL p99 meets the SLO (1: open loop).",
        )
        self.step_itl_p99 = gauge(
            "step_itl_p99_seconds",
            "p99 of the engine-side gaps between consecutive tokens "
            "of the SLO-governed tier's requests, over the SLO controller's window.",
        )
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV blocks held by live sequences (0 to 1).")
        # vLLM's cache_config_info: the pool each model was given, as labels on a constant 1.
        self.cache_config = gauge(
            "cache_config_info",
            "The KV cache each model was given (value 1).",
            ["model_name", "block_size", "num_blocks"],
        )
        # Pages of a CPU pool are backed on first touch, and the prefix cache's LRU free list hands every block out
        # in turn: resident memory grows by the pools over the first minutes of traffic. These two tell that growth
        # from a leak (carpool bench soak checks the rest of RSS for flatness).
        self.kv_pool_bytes = gauge("kv_cache_pool_bytes", "Bytes of the KV pools each model was given.")
        self.kv_resident_bytes = gauge(
            "kv_cache_resident_bytes", "Bytes of the KV pools backed by memory (pages are backed on first touch)."
        )
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", model)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", model)
        self.prefix_blocks = gauge("prefix_cache_blocks", "KV blocks holding a cached prefix (in use or not).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries so far.")
        # Cache breakpoints' TTL pins (carpool.engine.block_manager), read from the engine's snapshot at each scrape.
        ttl = ["model_name", "ttl"]
        self.pinned_blocks = gauge("cache_pinned_blocks", "KV blocks pinned by a cache breakpoint's TTL.", ttl)
        self.pinned_bytes = gauge("cache_pinned_bytes", "KV bytes pinned by a cache breakpoint's TTL.", ttl)
        self.pin_expired_blocks = counter(
            "cache_pin_expired_blocks", "Pinned KV blocks whose TTL lapsed without a hit.", ttl
        )
        self.pin_expiries = counter("cache_pin_expiries", "Pinned prefixes whose TTL lapsed without a hit.", model)
        self.pin_refused = counter(
            "cache_pin_refused", "Cache breakpoints not pinned because the pins' bound was reached.", model
        )
        self.pin_hits = counter("cache_pin_hits", "Requests that read a pinned prefix (each renews its TTL).", model)
        self.pin_hit_tokens = counter("cache_pin_hit_tokens", "Prompt tokens read from pinned KV blocks.", model)
        drafter = ["model_name", "drafter"]
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Sequence-steps that verified speculative drafts.", drafter
        )
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens proposed.", drafter)
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.", drafter)
        self.spec_accepted_length = histogram(
            "spec_decode_accepted_length", "Drafts accepted per verification.", drafter, ACCEPTED_LENGTH_BUCKETS
        )
        self.models = {name: Metrics(self, name) for name in model_names}
        # Set when the engines are replicas (carpool.server.replicas): registry -> text with their series merged.
        self.render_replicas = None

    def render(self, snapshots: dict[str, EngineSnapshot]) -> bytes:
        """The Prometheus text, with each model's gauges read from its engine's snapshot."""
        for name, snapshot in snapshots.items():
            self.models[name].set_gauges(snapshot)
        if self.render_replicas is not None:
            return self.render_replicas(self.registry)
        return generate_latest(self.registry)


class Metrics:
    """One served model's series."""

    def __init__(self, families: ServerMetrics, model_name: str):
        self.families, self.model_name = families, model_name
        self.itl = families.itl.labels(model_name)
        self.iteration_tokens = families.iteration_tokens.labels(model_name)
        self.iteration_seqs = families.iteration_seqs.labels(model_name)
        self.preemptions = families.preemptions.labels(model_name)
        self.prefix_queries = families.prefix_queries.labels(model_name)
        self.prefix_hits = families.prefix_hits.labels(model_name)
        self.running = families.running.labels(model_name)
        self.waiting = families.waiting.labels(model_name)
        self.kv_usage = families.kv_usage.labels(model_name)
        self.prefix_blocks = families.prefix_blocks.labels(model_name)
        self.prefix_hit_rate = families.prefix_hit_rate.labels(model_name)
        for tier in TIER_NAMES:  # every series exists from the start, so rates and "did it move" work from zero
            for family in (families.prompt_tokens, families.generation_tokens):
                family.labels(model_name, tier)
            for reason in FINISH_REASONS:
                families.request_success.labels(model_name, tier, reason)
        self._last_token_at: dict[str, float] = {}  # engine thread only
        self._budget_reason: tuple[str, str] | None = None  # engine thread only
        self._prefix_totals = [0, 0]  # prompt tokens queried, hit (event loop thread only)
        self._pins_seen = PinStats()  # the engine's pin counters at the last scrape (they only grow)

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """The engine's step listener (engine thread): batch shape, preemptions and inter-token gaps."""
        if stats is not None:
            self.iteration_tokens.observe(stats.num_tokens)
            self.iteration_seqs.observe(stats.num_seqs)
            self.preemptions.inc(stats.num_preemptions)
            if stats.limits is not None:
                self._on_limits(stats.limits)
            if stats.spec is not None:
                self._on_speculation(stats.spec)
        for output in outputs:
            token_at = output.times.last_token if output.times and output.delta_token_ids else None
            previous = self._last_token_at.get(output.request_id)
            if token_at is not None and previous is not None:
                self.itl.observe(token_at - previous)
            if output.finished:
                self._last_token_at.pop(output.request_id, None)
            elif token_at is not None:
                self._last_token_at[output.request_id] = token_at

    def _on_limits(self, limits) -> None:
        families = self.families
        families.step_token_budget.labels(self.model_name).set(limits.max_tokens)
        families.step_max_seqs.labels(self.model_name).set(limits.max_seqs)
        if limits.reason in ("itl", "ttft"):  # the factor of the latest step an ITL SLO governed
            families.step_target_factor.labels(self.model_name).set(limits.target_factor)
        if limits.itl_p99 is not None:
            families.step_itl_p99.labels(self.model_name).set(limits.itl_p99)
        reason = (limits.reason, limits.tier)
        if reason != self._budget_reason:
            if self._budget_reason is not None:
                families.step_budget_reason.labels(self.model_name, *self._budget_reason).set(0)
            families.step_budget_reason.labels(self.model_name, *reason).set(1)
            self._budget_reason = reason

    def _on_speculation(self, spec) -> None:
        families, labels = self.families, (self.model_name, spec.drafter)
        families.spec_drafts.labels(*labels).inc(spec.num_drafts)
        families.spec_draft_tokens.labels(*labels).inc(spec.num_draft_tokens)
        families.spec_accepted_tokens.labels(*labels).inc(spec.num_accepted_tokens)
        for length in spec.accepted_lengths:
            families.spec_accepted_length.labels(*labels).observe(length)

    def on_first_output(self, tier: str, output: RequestOutput) -> None:
        self.families.prompt_tokens.labels(self.model_name, tier).inc(output.num_prompt_tokens)
        self.prefix_queries.inc(output.num_prompt_tokens)
        self.prefix_hits.inc(output.num_cached_tokens)
        self._prefix_totals[0] += output.num_prompt_tokens
        self._prefix_totals[1] += output.num_cached_tokens

    def on_structured(self, kind: str) -> None:
        self.families.structured_requests.labels(self.model_name, kind).inc()

    def on_tokens(self, tier: str, output: RequestOutput, previous: RequestOutput | None) -> None:
        """A request's new tokens; `previous`, its output before this one (None for the first)."""
        self.families.generation_tokens.labels(self.model_name, tier).inc(len(output.delta_token_ids))
        last = previous.times.last_token if previous is not None and previous.times else None
        if last is not None and output.delta_token_ids and output.times:
            self.families.itl_by_tier.labels(self.model_name, tier).observe(output.times.last_token - last)

    def on_finished(self, tier: str, reason: str, output: RequestOutput | None) -> None:
        families = self.families
        families.request_success.labels(self.model_name, tier, reason).inc()
        times = output.times if output is not None else None
        if reason in ("stop", "length") and times is not None and times.finished is not None:
            labels = (self.model_name, tier)
            families.ttft.labels(*labels).observe(times.first_token - times.arrival)
            families.e2e.labels(*labels).observe(times.finished - times.arrival)
            families.queue.labels(*labels).observe(times.first_scheduled - times.arrival)
            families.prefill.labels(*labels).observe(times.first_token - times.first_scheduled)
            families.decode.labels(*labels).observe(times.finished - times.first_token)

    def set_gauges(self, snapshot: EngineSnapshot) -> None:
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.kv_usage.set(snapshot.kv_cache_usage)
        self.prefix_blocks.set(snapshot.num_cached_blocks)
        self.families.kv_pool_bytes.labels(self.model_name).set(snapshot.kv_pool_bytes)
        self.families.kv_resident_bytes.labels(self.model_name).set(snapshot.kv_resident_bytes)
        self.families.cache_config.labels(self.model_name, str(snapshot.block_size), str(snapshot.num_blocks)).set(1)
        queries, hits = self._prefix_totals
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self._set_pins(snapshot.pins, snapshot.kv_block_bytes)

    def _set_pins(self, pins: PinStats, block_bytes: int) -> None:
        families, seen = self.families, self._pins_seen
        for ttl, blocks in pins.pinned_blocks.items():
            families.pinned_blocks.labels(self.model_name, ttl_label(ttl)).set(blocks)
            families.pinned_bytes.labels(self.model_name, ttl_label(ttl)).set(blocks * block_bytes)
        for ttl, blocks in pins.expired_blocks.items():
            families.pin_expired_blocks.labels(self.model_name, ttl_label(ttl)).inc(blocks - seen.expired_blocks[ttl])
        families.pin_expiries.labels(self.model_name).inc(pins.expiries - seen.expiries)
        families.pin_refused.labels(self.model_name).inc(pins.refused - seen.refused)
        families.pin_hits.labels(self.model_name).inc(pins.hits - seen.hits)
        families.pin_hit_tokens.labels(self.model_name).inc(pins.hit_tokens - seen.hit_tokens)
        self._pins_seen = pins


def ttl_label(seconds: float) -> str:
    """A TTL as Anthropic names it: 300 -> 5m, 3600 -> 1h; others in seconds."""
    if seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"
