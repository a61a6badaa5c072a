"""The replica simulator: its step model fit, its timing against hand-computed cases, and the routing effect it
exists to predict (prefix affinity keeps hit rate; more replicas cut queueing)."""

import math
import random
import statistics

import pytest

from carpool.bench.sessions import Session, Turn
from carpool.bench.simulate import Job, ReplicaSpec, StepModel, poisson_arrivals, replay, simulate
from carpool.engine.step_shape import attention_pairs

STEP = StepModel(base=0.010, per_prefill_token=0.0001, per_decode_seq=0.002)
WITH_CONTEXT = StepModel(base=0.010, per_prefill_token=0.0001, per_decode_seq=0.002, per_context_token=0.00001)
WHOLE = StepModel(0.006, 0.0001, 0.001, 0.00001, per_prefill_step=0.008, per_prefill_pair=2e-8)


def test_fit_recovers_a_known_step_plane():
    rng = random.Random(1)
    shapes = [
        (0, 1, 16),
        (0, 8, 128),
        (0, 32, 512),
        (256, 0, 0),
        (512, 0, 0),
        (128, 4, 2048),
        (64, 16, 8192),
        (0, 8, 4096),
        (0, 1, 700),
    ]
    steps = [(p, d, c, WITH_CONTEXT.seconds(p, d, c) * (1 + rng.uniform(-0.01, 0.01))) for p, d, c in shapes]
    fitted = StepModel.fit(steps)
    assert fitted.base == pytest.approx(WITH_CONTEXT.base, rel=0.1)
    assert fitted.per_prefill_token == pytest.approx(WITH_CONTEXT.per_prefill_token, rel=0.05)
    assert fitted.per_decode_seq == pytest.approx(WITH_CONTEXT.per_decode_seq, rel=0.1)
    assert fitted.per_context_token == pytest.approx(WITH_CONTEXT.per_context_token, rel=0.1)
    # Steps without a context column fit the three-term line, as `--step BASE,PREFILL,DECODE` gives one.
    assert StepModel.fit([(p, d, s) for p, d, _, s in steps]).per_context_token == 0.0
    with pytest.raises(ValueError, match="steps"):
        StepModel.fit(steps[:3])


def test_fit_separates_a_prompt_steps_own_cost_and_its_attention_pairs():
    # Prompts alone (pairs grow with the square of their length), prompts behind a cached prefix (few tokens, many
    # pairs), decode batches and mixed steps, as measure_step_model runs them.
    shapes = [
        (64, 0, 0, attention_pairs(64, 0)),
        (256, 0, 0, attention_pairs(256, 0)),
        (512, 0, 0, attention_pairs(512, 0)),
        (32, 0, 0, attention_pairs(32, 768)),
        (128, 0, 0, attention_pairs(128, 768)),
        (0, 1, 17, 0),
        (0, 4, 3072, 0),
        (0, 16, 272, 0),
        (0, 32, 24_576, 0),
        (480, 32, 512, attention_pairs(480, 256)),
    ]
    fitted = StepModel.fit([(*shape, WHOLE.seconds(*shape)) for shape in shapes])
    for name in ("base", "per_prefill_token", "per_decode_seq", "per_context_token", "per_prefill_step"):
        assert getattr(fitted, name) == pytest.approx(getattr(WHOLE, name), rel=1e-6), name
    assert fitted.per_prefill_pair == pytest.approx(WHOLE.per_prefill_pair, rel=1e-6)
    assert StepModel.parse("0.006,0.0001,0.001,0.00001,0.008,2e-8") == WHOLE
    with pytest.raises(ValueError, match="--step"):
        StepModel.parse("0.006,0.0001")


def test_a_prompt_behind_a_cached_prefix_pays_a_prompt_steps_cost_and_its_pairs():
    prefix = list(range(1, 801))  # 50 whole blocks
    first, second = Turn(prefix + [7] * 10, 1), Turn(prefix + list(range(900, 940)), 2)
    result = simulate([Session([first, second])], [0.0], 1, "prefix", WHOLE, ReplicaSpec())
    # The second turn computes its 40 new tokens over the 800 cached, then decodes over 841 keys.
    assert result.ttft[1] == pytest.approx(WHOLE.seconds(40, 0, 0, 40 * 800 + 40 * 41 // 2))
    assert result.itl == [pytest.approx(WHOLE.seconds(0, 1, 841))]


def test_a_decode_step_pays_for_the_context_its_sequences_read():
    short, long_ = list(range(1, 33)), list(range(1, 801))
    itl = {
        len(prompt): simulate(
            [Session([Turn(prompt, 3)])], [0.0], 1, "prefix", WITH_CONTEXT, ReplicaSpec(max_num_batched_tokens=1024)
        ).itl
        for prompt in (short, long_)
    }
    assert itl[32][0] == pytest.approx(WITH_CONTEXT.seconds(0, 1, 32 + 1))
    assert itl[800][0] == pytest.approx(WITH_CONTEXT.seconds(0, 1, 800 + 1))


def test_one_request_takes_one_prefill_step_then_one_decode_step_a_token():
    prompt = list(range(1, 301))
    result = simulate([Session([Turn(prompt, 5)])], [0.0], 1, "prefix", STEP, ReplicaSpec())
    assert result.ttft == [pytest.approx(STEP.seconds(300, 0))]
    assert result.itl == [pytest.approx(STEP.seconds(0, 1))] * 4
    # A 300-token prompt under a 128-token budget takes three chunks.
    chunked = simulate([Session([Turn(prompt, 1)])], [0.0], 1, "prefix", STEP, ReplicaSpec(max_num_batched_tokens=128))
    assert chunked.ttft == [pytest.approx(STEP.seconds(128, 0) * 2 + STEP.seconds(44, 0))]


def document_sessions(documents=7, questions=6, length=600):
    rng = random.Random(0)
    docs = [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(documents)]
    return [
        Session([Turn(doc + [rng.randrange(1000, 30000) for _ in range(12)], 4)], salt=f"tenant{d % 3}")
        for _ in range(questions)
        for d, doc in enumerate(docs)
    ]


def test_prefix_routing_keeps_the_hit_rate_that_round_robin_loses():
    sessions = document_sessions()
    arrivals = poisson_arrivals(len(sessions), rate=4.0)
    rates = {
        routing: simulate(sessions, arrivals, 4, routing, STEP, ReplicaSpec()).summary(1.0)["hit_rate"]
        for routing in ("prefix", "round-robin")
    }
    assert rates["prefix"] > 0.8 and rates["prefix"] > 1.5 * rates["round-robin"], rates


def test_more_replicas_cut_ttft_under_the_same_load():
    sessions = document_sessions()
    arrivals = poisson_arrivals(len(sessions), rate=200.0)
    ttft = {
        n: simulate(sessions, arrivals, n, "prefix", STEP, ReplicaSpec()).summary(1.0)["ttft_p50_s"] for n in (1, 4)
    }
    assert ttft[4] < ttft[1] / 2, ttft


def test_the_slo_controller_keeps_a_priority_stream_within_its_itl_under_long_flex_prompts():
    """The engine's own controller, fed the simulated steps: fixed 512-token steps stretch the priority stream's
    gaps past half a second while the flex prompts compute; with a 100 ms ITL target it cuts the chunks so the
    stream's gaps stay near the target, and the flex prompts still finish."""
    slow = StepModel(base=0.010, per_prefill_token=0.001, per_decode_seq=0.002)
    jobs = [Job(0.0, 32, (), 80, "priority")] + [Job(0.05 * i, 1500, (), 2, "flex") for i in range(1, 4)]
    fixed = replay(jobs, 1, "prefix", slow, ReplicaSpec())
    governed = replay(jobs, 1, "prefix", slow, ReplicaSpec(slo_itl_ms={"priority": 100.0}))
    assert max(fixed.itl_by_tier["priority"]) > 0.5
    gaps = governed.itl_by_tier["priority"]
    assert max(gaps[10:]) < 0.12, gaps  # past the controller's first steps of learning the step times
    assert len(governed.ttft_by_tier["flex"]) == 3 and len(governed.finished_by_job) == 4


def test_a_coefficient_the_steps_would_make_negative_is_zero_and_the_rest_refitted():
    # Decode steps whose time falls with their context (noise, a cache warming up) must not buy a negative
    # per-context cost, nor leave the other terms fitted to it.
    steps = [(0, d, c, 0.010 + 0.002 * d - 1e-7 * c) for d in (1, 4, 16, 32) for c in (16, 768, 24_576)]
    steps += [(p, 0, 0, attention_pairs(p, 0), 0.010 + 0.001 * p) for p in (64, 256, 512)]
    fitted = StepModel.fit(steps)
    assert fitted.per_context_token == 0.0
    assert min(vars(fitted).values()) >= 0.0
    # The rest is the least-squares fit without that term: its errors are orthogonal to every other term's column.
    residuals = [seconds - fitted.seconds(*shape) for *shape, seconds in steps]
    columns = {"base": [1.0] * len(steps), "per_decode_seq": [step[1] for step in steps]}
    for name, column in columns.items():
        assert abs(sum(r * x for r, x in zip(residuals, column))) < 1e-9, name


def test_the_fit_measures_a_prompt_behind_a_cached_prefix_by_its_chunk_and_pairs():
    from carpool.bench.simulate import measured_steps
    from carpool.engine.config import EngineConfig

    steps = measured_steps(
        EngineConfig(num_kv_blocks=64, max_num_seqs=4),
        prompt_lengths=(48,),
        batch_sizes=(1, 2),
        contexts=(16, 64),
        hit_suffixes=(8,),
        decode_steps=2,
    )
    shapes = [step[:4] for step in steps]
    assert (48, 0, 0, attention_pairs(48, 0)) in shapes  # a prompt alone
    assert (8, 0, 0, attention_pairs(8, 64)) in shapes  # 8 new tokens over the 64 cached
    # Decode-only steps of two sequences read their contexts: two prompts of 64 and the tokens decoded since.
    assert any(p == 0 and d == 2 and c >= 2 * 64 and pairs == 0 for p, d, c, pairs in shapes)
    assert all(seconds > 0 for *_, seconds in steps)


def test_the_fit_keeps_the_steps_spread_and_the_simulator_draws_each_step_around_the_plane():
    rng = random.Random(2)
    shapes = [
        (p, d, c, attention_pairs(p, 0) if p else 0) for p in (0, 64, 512) for d in (0, 1, 8, 32) for c in (0, 900)
    ]
    shapes = [shape for shape in shapes if shape[0] or shape[1]] * 20
    steps = [(*shape, WHOLE.seconds(*shape) * math.exp(rng.gauss(0.0, 0.2))) for shape in shapes]
    assert StepModel.fit(steps).noise == pytest.approx(0.2, rel=0.15)
    noisy = StepModel(**{**vars(WHOLE), "noise": 0.2})
    jobs = [Job(0.0, 32, (), 200)]
    first, again = (replay(jobs, 1, "prefix", noisy, ReplicaSpec()).itl for _ in range(2))
    assert first == again  # seeded: the same replay, the same times
    # Around the plane: the 200 gaps spread, their median where the noiseless step over the median context is.
    assert max(first) / min(first) > 1.5
    assert statistics.median(first) == pytest.approx(WHOLE.seconds(0, 1, 32 + 100), rel=0.1)


def test_under_slo_steps_a_lower_tiers_prompt_moves_on_its_held_block_through_a_stream_of_priority_prompts():
    """The controller holds a block of each step for a lower tier's prompt (Scheduler's hold): a flex prompt
    finishes while priority prompts still queue, instead of after the last of them."""
    slow = StepModel(base=0.010, per_prefill_token=0.001, per_decode_seq=0.002)
    stream = [Job(0.02 * i, 200, (), 3, "priority") for i in range(60)]
    jobs = [*stream, Job(0.01, 400, (), 2, "flex")]
    governed = replay(jobs, 1, "prefix", slow, ReplicaSpec(slo_itl_ms={"priority": 100.0}))
    flex_ttft, last_priority = governed.ttft_by_tier["flex"][0], max(governed.ttft_by_tier["priority"])
    assert flex_ttft < 0.5 * (0.02 * 59 + last_priority)


def test_under_slo_steps_a_surge_sheds_the_running_batch_lines_and_they_finish_after_it():
    """The scheduler's surge rule (Scheduler._shed_background): 48 Batch lines decoding when a priority chat
    arrives step aside, so the chat decodes in small steps, and the lines come back (their blocks cached) and
    finish; the prompt tokens they recompute are no new prompt tokens."""
    slow = StepModel(base=0.010, per_prefill_token=0.0005, per_decode_seq=0.003)  # 48 decodes: ~154 ms a step
    lines = [Job(0.0, 40, (), 60, "batch") for _ in range(48)]
    jobs = [*lines, Job(1.0, 40, (), 40, "priority")]
    governed = replay(jobs, 1, "prefix", slow, ReplicaSpec(slo_itl_ms={"priority": 100.0}))
    gaps = governed.itl_by_tier["priority"]
    # Within the SLO throughout (the cap lets lines back in as the model learns: 27 ms gaps, then up to ~76 ms, the
    # controller's aim), where steps of the 48 lines' decodes and the chat's took 157 ms.
    assert max(gaps) < 0.1 and slow.seconds(0, 49) > 0.15, gaps
    assert len(governed.finished_by_job) == 49 and governed.prompt_tokens == 49 * 40
    assert max(governed.finished_by_job[i] for i in range(48)) > governed.finished_by_job[48]


def test_prompt_work_runs_in_the_schedulers_rank_order_not_running_chunks_first():
    """As the engine's scheduler: a priority prompt arriving while a default-tier document is being chunked in
    takes the next step's budget; it is not queued behind the document's remaining chunks."""
    slow = StepModel(base=0.010, per_prefill_token=0.001, per_decode_seq=0.010)
    jobs = [Job(0.0, 1024, (), 2, "default"), Job(0.1, 64, (), 2, "priority")]
    result = replay(jobs, 1, "prefix", slow, ReplicaSpec(max_num_batched_tokens=64))
    # 74 ms chunks of the document: the priority prompt goes in the step starting at 148 ms, first token at 222.
    assert result.ttft_by_job[1] == pytest.approx(0.222 - 0.1)
    # The document: two chunks, the priority prompt's step, 63 tokens beside its decode (83 ms), 13 chunks of 64
    # and the last token (11 ms), where running chunks first gave it 16 x 74 ms and the priority prompt waited.
    assert result.ttft_by_job[0] == pytest.approx(2 * 0.074 + 0.074 + 0.083 + 13 * 0.074 + 0.011)


def test_a_waiting_request_ages_past_a_younger_one_of_a_better_tier():
    """The scheduler's aging: one tier a priority_aging_seconds waited (two at most). With one slot held for a
    minute, the default request that waited 60 s goes before the priority one that waited 29 s."""
    step = StepModel(base=0.010, per_prefill_token=0.0, per_decode_seq=0.010)
    jobs = [Job(0.0, 16, (), 3000, "priority"), Job(0.001, 16, (), 2, "default"), Job(31.0, 16, (), 2, "priority")]
    aged = replay(jobs, 1, "prefix", step, ReplicaSpec(max_num_seqs=1))
    assert aged.finished_by_job[1] < aged.finished_by_job[2]
    unaged = replay(jobs, 1, "prefix", step, ReplicaSpec(max_num_seqs=1, priority_aging_seconds=1e9))
    assert unaged.finished_by_job[2] < unaged.finished_by_job[1]


def test_a_batch_lines_decode_sits_out_the_steps_that_compute_a_live_prompt():
    """As the engine's scheduler: a Batch API line does not decode beside a live request's prompt chunks."""
    step = StepModel(base=0.010, per_prefill_token=0.001, per_decode_seq=0.010)
    jobs = [Job(0.0, 16, (), 3, "batch"), Job(0.030, 128, (), 1, "default")]
    result = replay(jobs, 1, "prefix", step, ReplicaSpec(max_num_batched_tokens=64))
    # Its prompt (26 ms), a decode (20 ms), then it waits out both 74 ms chunks of the live prompt, then decodes:
    # beside the first chunk instead, its last gap would have been one 83 ms step.
    assert result.itl_by_tier["batch"] == pytest.approx([0.020, 0.074 + 0.074 + 0.020])
