"""SLO-driven step sizing: the step-time model, the controller's budget and cap in the scheduler, no starvation,
the gauges, and the flags. Scheduler tests run without a model; one test drives the real engine."""

import time

import numpy as np
import pytest
from prometheus_client import generate_latest

from carpool import LLM
from carpool.cli import build_parser
from carpool.engine.block_manager import BlockManager
from carpool.engine.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.scheduler import Scheduler
from carpool.engine.sequence import Sequence
from carpool.engine.slo import ERROR_SIGMAS, StepTimeModel
from carpool.engine.tiers import BY_NAME
from carpool.server.assembly import model_configs
from carpool.server.dashboard.data import DashboardData
from carpool.server.metrics import ServerMetrics

PRIORITY, FLEX, BATCH = (BY_NAME[name].priority for name in ("priority", "flex", "batch"))
# A slow machine: 5 ms a step, 0.4 ms a token, so a 512-token step takes ~210 ms.
FIXED, PER_TOKEN = 0.005, 0.0004


def scheduler(itl_ms=None, ttft_ms=None, max_seqs=16, budget=512, aging=30.0):
    config = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        priority_aging_seconds=aging,
        slo_itl_ms=itl_ms or {},
        slo_ttft_ms=ttft_ms or {},
    )
    return Scheduler(config, BlockManager(1024, 16, False))


def teach_slow_steps(s: Scheduler, repeats: int = 4) -> None:
    """Feed the controller steps of mixed shapes that took FIXED + PER_TOKEN * tokens."""
    now = time.monotonic()
    for tokens in (1, 8, 64, 512, 4, 256, 32, 128) * repeats:
        seqs = min(tokens, 4)
        s.slo.observe(tokens, seqs, 100 * seqs, now, now + FIXED + PER_TOKEN * tokens, work_left=False)


def request(name, priority, length=8, max_tokens=50):
    return Sequence(name, list(range(100, 100 + length)), SamplingParams(max_tokens=max_tokens), priority=priority)


def step(s: Scheduler):
    """Schedule, then pretend the model ran; sequences that reached max_tokens finish."""
    batch = s.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            seq.times.first_token = seq.times.first_token or time.monotonic()
            if seq.num_output_tokens >= seq.params.max_tokens:
                s.remove(seq)
    return batch


def test_step_time_model_recovers_a_known_step_time():
    model, rng = StepTimeModel(), np.random.default_rng(0)
    a, b, c, d = 0.004, 0.0003, 0.0002, 5e-7
    for _ in range(300):
        tokens, seqs, context = rng.integers(1, 512), rng.integers(1, 32), rng.integers(0, 20_000)
        model.observe(tokens, seqs, context, a + b * tokens + c * seqs + d * context + rng.normal(0, 1e-4))
    for tokens, seqs, context in ((1, 1, 100), (32, 32, 16_000), (512, 4, 2_000)):
        truth = a + b * tokens + c * seqs + d * context
        assert model.predict(tokens, seqs, context) == pytest.approx(truth, rel=0.05)
    assert model.error_std < 5e-4


def test_budget_shrinks_to_meet_a_priority_itl_slo_when_steps_are_slow():
    s = scheduler(itl_ms={"priority": 50})
    teach_slow_steps(s)
    chat, backlog = request("chat", PRIORITY), request("backlog", BATCH, length=2000)
    s.add(chat)
    step(s)  # the chat's prompt; now it decodes every step
    s.add(backlog)
    batch = step(s)
    limits = s.limits
    assert (limits.reason, limits.tier) == ("itl", "priority")
    assert batch.num_tokens <= limits.max_tokens < 512
    # The step the budget allows fits the SLO on the slow machine; the fixed 512 would have taken ~210 ms.
    assert FIXED + PER_TOKEN * batch.num_tokens <= 0.050
    assert chat in batch.seqs and batch.num_tokens > 1  # the chat decodes and the backlog's prompt still moves


def test_step_grows_to_the_ceiling_when_only_batch_and_flex_work_is_present():
    s = scheduler(itl_ms={"priority": 50})
    teach_slow_steps(s)
    s.add(request("backlog", BATCH, length=2000))
    s.add(request("flex", FLEX, length=600))
    batch = step(s)
    assert (s.limits.max_tokens, s.limits.max_seqs, s.limits.reason) == (512, 16, "throughput")
    assert batch.num_tokens == 512


def test_without_slos_the_limits_are_the_fixed_flags():
    s = scheduler(budget=256)
    s.add(request("chat", PRIORITY, length=600))
    assert step(s).num_tokens == 256
    assert (s.limits.max_tokens, s.limits.reason) == (256, "fixed")


def test_the_cap_holds_back_lower_tiers_but_admits_the_protected_one():
    s = scheduler(itl_ms={"priority": 1})  # no step meets 1 ms: the cap falls to its floor
    teach_slow_steps(s)
    for i in range(2):
        s.add(request(f"chat-{i}", PRIORITY))
    for i in range(4):
        s.add(request(f"batch-{i}", BATCH))
    for _ in range(3):
        step(s)
    running = {seq.request_id for seq in s.running}
    assert s.limits.max_seqs == 3  # two chats and one slot for the lower tier
    assert running == {"chat-0", "chat-1", "batch-0"}
    s.add(request("chat-2", PRIORITY))
    step(s)
    assert "chat-2" in {seq.request_id for seq in s.running}  # past the cap: it is the tier the cap protects


def test_a_surge_sheds_running_batch_lines_beyond_the_cap_but_never_a_live_tier():
    s = scheduler(itl_ms={"priority": 1})  # no step meets 1 ms: the cap falls to its floor
    teach_slow_steps(s)
    for i in range(6):
        s.add(request(f"batch-{i}", BATCH, length=40, max_tokens=500))
    s.add(request("flex", FLEX, length=40, max_tokens=500))
    for _ in range(4):
        step(s)
    assert len(s.running) == 7  # no live tier with an ITL SLO yet: throughput steps, everyone runs
    s.add(request("chat", PRIORITY))
    batch = step(s)
    # The cap (one chat, one slot for lower tiers) sheds the Batch lines, worst first, in the chat's own step;
    # the flex request is a live tier's and stays, past the cap, until it finishes.
    assert {seq.request_id for seq in s.running} == {"chat", "flex"}
    assert "chat" in {seq.request_id for seq in batch.seqs} and len(batch.preempted) == 6
    assert all(seq.status.name == "WAITING" and seq.num_computed_tokens == 0 for seq in s.waiting)
    for _ in range(3):
        step(s)
    assert {seq.request_id for seq in s.running} == {"chat", "flex"}  # they wait while the chat decodes
    s.remove(next(seq for seq in s.running if seq.request_id == "chat"))
    step(s)
    assert sum(seq.priority == BATCH for seq in s.running) == 6  # the surge over: back, their blocks from cache


def test_a_flex_request_is_still_served_under_sustained_priority_load():
    s = scheduler(itl_ms={"priority": 1}, aging=0.01)
    teach_slow_steps(s)
    chats = iter(range(10_000))
    for _ in range(3):
        s.add(request(f"chat-{next(chats)}", PRIORITY, length=24, max_tokens=2))
    flex = request("flex", FLEX, length=160, max_tokens=3)
    s.add(flex)
    for _ in range(200):
        step(s)
        while sum(seq.priority == PRIORITY for seq in s.running + s.waiting) < 3:  # load never lets up
            s.add(request(f"chat-{next(chats)}", PRIORITY, length=24, max_tokens=2))
        if flex.status.name == "FINISHED":
            break
    assert flex.status.name == "FINISHED", f"flex starved: {flex.num_output_tokens} tokens after 200 steps"
    assert next(chats) > 6  # chats kept finishing and arriving meanwhile


def test_a_ttft_slo_raises_the_budget_for_a_long_priority_prompt():
    s = scheduler(itl_ms={"priority": 50}, ttft_ms={"priority": 600})
    teach_slow_steps(s)
    s.add(request("chat", PRIORITY))
    step(s)
    s.add(request("long", PRIORITY, length=1500))
    step(s)
    assert (s.limits.reason, s.limits.tier) == ("ttft", "priority")
    # 1500 tokens in chunks of the ITL budget (~110 tokens, 14 steps of 50 ms) miss 600 ms; larger chunks do not.
    assert s.limits.max_tokens >= 256


def test_the_engine_sizes_steps_from_its_own_timings_and_exports_them():
    llm = LLM(max_num_seqs=8, max_num_batched_tokens=64, slo_itl_ms={"priority": 1})
    engine = llm.engine
    metrics = ServerMetrics(["m"])
    params = SamplingParams(max_tokens=3, temperature=0)
    engine.add_request("chat", "Hi there", params, tier="priority")
    engine.add_request("backlog", "Summarize this. " * 30, params, tier="flex")
    budgets, chat_token_times = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        chat_token_times += [o.times.last_token for o in outputs if o.request_id == "chat" and o.delta_token_ids]
        budgets.append((engine.last_step.limits, engine.last_step.num_tokens))
        metrics.models["m"].on_step(engine.last_step, [])
    assert engine.scheduler.slo.model.error_weight > 0  # it learnt from the steps it ran
    # ...and the two live requests' computed prompt tokens per output token, for live_capacity (a mean, EW).
    prompts = [len(engine.tokenizer.encode(text)) for text in ("Hi there", "Summarize this. " * 30)]
    assert min(prompts) / 3 < engine.scheduler.slo._prompt_per_output < max(prompts) / 3
    # ...and measured the gaps the ITL SLO is about: the priority chat's, between its consecutive tokens.
    chat_gaps = np.diff(chat_token_times)
    assert list(engine.scheduler.slo.tail.gaps) == pytest.approx(chat_gaps)
    assert budgets[-1][0].itl_p99 == pytest.approx(np.quantile(chat_gaps, 0.99))
    assert all(tokens <= limits.max_tokens for limits, tokens in budgets)
    reasons = [limits.reason for limits, _ in budgets]
    assert "itl" in reasons and reasons[-1] == "throughput"  # the flex prompt finishes alone, at full size
    assert min(limits.max_tokens for limits, _ in budgets) < 64
    text = generate_latest(metrics.registry).decode()
    assert 'carpool:step_token_budget{model_name="m"} 64.0' in text
    assert 'carpool:step_budget_reason{model_name="m",reason="throughput",tier=""} 1.0' in text
    assert 'carpool:step_budget_reason{model_name="m",reason="itl",tier="priority"} 0.0' in text
    assert 'carpool:step_itl_p99_seconds{model_name="m"}' in text
    assert 'carpool:step_target_factor{model_name="m"} 1.0' in text  # 1 ms: no target to scale, open loop
    (shown,) = DashboardData(metrics.registry, ["m"], time.time()).document()["models"]
    assert (shown["gauges"]["step_token_budget"], shown["step_budget_reason"]) == (64, "throughput")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("slo_itl_ms", {"gold": 50}, "slo_itl_ms: tier must be one of"),
        ("slo_itl_ms", {"priority": 0}, r"slo_itl_ms\['priority'\] must be a positive number"),
        ("slo_ttft_ms", {"priority": "fast"}, r"slo_ttft_ms\['priority'\] must be a positive number"),
        ("slo_ttft_ms", [("priority", 5)], "slo_ttft_ms must be a dict"),
    ],
)
def test_bad_slos_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_serve_flags_become_the_engine_slos():
    argv = ["serve", "--slo-itl-ms", "priority=50", "--slo-itl-ms", "default=120", "--slo-ttft-ms", "priority=800"]
    (config,) = model_configs(build_parser().parse_args(argv)).values()
    assert config.slo_itl_ms == {"priority": 50.0, "default": 120.0}
    assert config.slo_ttft_ms == {"priority": 800.0}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slo-itl-ms", "gold=50"], "--slo-itl-ms: tier must be one of"),
        (["--slo-itl-ms", "priority"], "--slo-itl-ms: expected TIER=MS"),
        (["--slo-ttft-ms", "priority=-3"], "--slo-ttft-ms: MS must be a positive number"),
        (["--slo-ttft-ms", "priority=abc"], "--slo-ttft-ms: MS must be a positive number"),
        (["--slo-itl-ms", "priority=50", "--slo-itl-ms", "priority=60"], "--slo-itl-ms: tier 'priority' given twice"),
    ],
)
def test_bad_slo_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        model_configs(build_parser().parse_args(["serve", *argv]))


def decoding(s: Scheduler, priority: int, name: str) -> Sequence:
    """A request admitted and past its prompt, decoding from now on."""
    seq = request(name, priority)
    s.add(seq)
    while not seq.num_output_tokens:
        step(s)
    return seq


def test_speculative_lookahead_leaves_every_decode_its_token_and_the_held_block():
    s = scheduler(itl_ms={"priority": 1}, max_seqs=32)  # no step meets 1 ms: the budget falls to its floor
    teach_slow_steps(s)
    flex = [decoding(s, FLEX, f"flex-{i}") for i in range(10)]  # alone, flex work runs at the ceilings
    chats = [decoding(s, PRIORITY, f"chat-{i}") for i in range(10)]  # the protected tier is admitted past the cap
    prompt = request("default-prompt", BY_NAME["default"].priority, length=64)  # lower tier, not capped
    s.add(prompt)
    for seq in flex + chats:
        seq.num_lookahead_tokens = 4
    batch = s.schedule()
    assert s.limits.max_tokens < 20 + 4 * 20 + 16  # drafts for everyone do not fit
    assert set(flex + chats) <= set(batch.seqs)  # every decode runs; drafts come from what is left
    assert batch.num_new_tokens[batch.seqs.index(prompt)] == 16  # nor the block held for a lower tier's prompt


def test_a_held_block_never_stalls_a_priority_prompt_that_a_lower_prompt_waits_on():
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=16, slo_itl_ms={"priority": 50})
    s = Scheduler(config, BlockManager(64, 16, True))
    teach_slow_steps(s)
    prompt = list(range(100, 164))
    chat = Sequence("chat", prompt, SamplingParams(max_tokens=2), priority=PRIORITY)
    s.add(chat)
    step(s)  # one 16-token chunk, which lands in the prefix cache
    s.block_manager.cache_full_blocks(chat)
    flex = Sequence("flex", prompt[:32] + list(range(500, 532)), SamplingParams(max_tokens=2), priority=FLEX)
    s.add(flex)
    for _ in range(40):
        if not s.has_work():
            break
        batch = s.schedule()
        assert batch, "an empty step while work is left"
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            s.block_manager.cache_full_blocks(seq)  # what the engine does after each step
            if seq.num_computed_tokens == seq.num_tokens:
                s.remove(seq)  # its first token is all this test needs
    assert not s.has_work()


def test_the_cap_never_holds_a_higher_tier_behind_a_lower_one():
    s = scheduler(itl_ms={"priority": 1})
    teach_slow_steps(s)
    chats = [decoding(s, PRIORITY, f"chat-{i}") for i in range(2)]
    flex = decoding(s, FLEX, "flex")
    assert s.limits.max_seqs == 3 and set(s.running) == {*chats, flex}  # the lower tiers' one slot is flex's
    default = request("default", BY_NAME["default"].priority)
    s.add(default)
    s.add(request("flex-2", FLEX))
    step(s)
    running = {seq.request_id for seq in s.running}
    assert "default" in running  # it outranks the flex request in the lower tiers' slot
    assert "flex-2" not in running  # the cap still holds the tier below


def test_live_capacity_is_the_decode_batch_whose_step_fits_the_tightest_itl_slo():
    assert scheduler().slo is None
    wide, tight = scheduler(itl_ms={"priority": 60, "default": 200}), scheduler(itl_ms={"priority": 30})
    teach_slow_steps(wide)
    assert wide.slo.live_capacity(500) is None  # 32 steps: not yet said (the autoscaler sizes by the slots)
    for s in (wide, tight):
        teach_slow_steps(s, repeats=40)

    def step_seconds(s, seqs):  # seqs decodes and a block of prompt, with the margin the controller keeps
        return s.slo.model.predict(seqs + 16, seqs, 0) + ERROR_SIGMAS * s.slo.model.error_std

    for s, slo in ((wide, 0.060), (tight, 0.030)):
        capacity = s.slo.live_capacity(500)
        assert step_seconds(s, capacity) <= slo < step_seconds(s, capacity + 1)
    # On the slow machine (5 ms + 0.4 ms a token) about 80 and 20 requests; the slots bound it.
    assert tight.slo.live_capacity(500) < wide.slo.live_capacity(500) and wide.slo.live_capacity(16) == 16
    hopeless = scheduler(itl_ms={"priority": 4})
    teach_slow_steps(hopeless, repeats=40)
    assert hopeless.slo.live_capacity(500) == 1  # no step meets 4 ms: one request a replica, never zero


def test_live_capacity_counts_each_live_requests_prompt_over_its_decode_steps():
    s = scheduler(itl_ms={"priority": 60})
    teach_slow_steps(s, repeats=40)
    decode_only = s.slo.live_capacity(500)
    for _ in range(50):
        s.slo.observe_finished(BATCH, 4000, 10)  # the Batch API's lines are not live demand
    assert s.slo.live_capacity(500) == decode_only
    for _ in range(200):
        s.slo.observe_finished(PRIORITY, 448, 64)  # chats of 448 computed prompt tokens and 64 answer tokens
    # Each brings 1 + 448 / 64 = 8 tokens a step: about an eighth as many fit (the per-sequence cost is small here).
    chats = s.slo.live_capacity(500)
    c = s.slo.model.coefficients()
    per_request = 8 * c["token"] + c["sequence"]
    assert chats == pytest.approx(decode_only * (c["token"] + c["sequence"]) / per_request, abs=1)
    assert chats < decode_only / 5
