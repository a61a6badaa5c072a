"""SLO-driven step sizing: each step's token budget and sequence cap, from the engine's own measured step times.

A decode step's time is every running sequence's inter-token gap, so the step is the lever on ITL: a long
prompt chunked at 512 tokens under a batch of decodes stretches every stream's next token by the chunk's
compute. The step-time model is the cost model's (carpool.economics.cost_model: weights read once per step,
each sequence's KV read, compute per token) fitted online:

    seconds ~ a + b * tokens + c * sequences + d * context tokens (the KV each step reads)

by exponentially weighted least squares over recent steps, pulled toward a prior so the first steps and
collinear data (decode-only steps have tokens == sequences) stay sane. Before every step the controller picks:
- only tiers without an ITL SLO present (flex / batch work, or nothing): the configured ceilings,
  `max_num_batched_tokens` and `max_num_seqs`. Under this model tokens per second rise with the step's size
  (the fixed cost a is shared), so the throughput-optimal step is the largest one memory and the flags allow.
- the highest tier present has an ITL SLO: the largest token budget whose predicted step time, plus the gap
  measured between steps and two standard deviations of the model's error (ITL is judged at p99), fits the
  SLO; and a sequence cap, the largest decode batch that fits it. Running sequences are never dropped by
  it (the budget always covers every running decode plus one block of prompt, so prompts still progress): the
  cap only stops admissions of lower tiers, so the batch shrinks as they finish, without recomputing anyone.
  Sequences of the governing tier or higher are admitted past it: refusing them would not help their ITL and
  would ruin their TTFT.
- a waiting or prefilling request of a tier with a TTFT SLO (the governing tier or higher) that would miss
  it at that budget (its prompt and the prompts ranked before it, chunk by chunk) raises the budget to the
  smallest that meets it.
The model's step is not the SLO's gap, though: aiming the predicted step at the SLO less the mean gap between
steps and two sigmas of the model's error left the priority ITL p99 at 91-121 ms against a 100 ms SLO in the load
trace's peak minutes (SmolLM2, quiet machine): the p99 of the gaps also holds steps slower than the model says,
stalls between steps, and prompt chunks the fit underrates. So the loop is closed on what the SLO is about
(`TailFeedback`): the engine reports the realised gap between consecutive tokens of each of the governing tier's
sequences, the controller keeps the last TAIL_WINDOW of them, each as a ratio to the step-time target of the step
that ended it, and scales the open-loop target by the factor that puts the window's p99 ratio times the target at
TAIL_AIM of the SLO. Ratios, not raw gaps: a window still holding gaps from before a correction then says the
same thing as a fresh one (no integrator to wind up), and steps the target did not size (a budget on its floor,
or raised for a TTFT) are left out, so the factor cannot run away where it has no effect.
Admission order is the scheduler's own (tier with aging, then arrival), and no tier starves under a small
step: the cap never falls below the governing tier's sequences plus one slot for any lower tier (so a lower
tier always has a running sequence that decodes every step, and the next one in rank order takes its slot),
and one block of each step's budget beyond the governing tier's own block of prompt is held for lower tiers'
prompts while one can run (the scheduler drops the hold when every lower prompt waits on the cap or on blocks a
running prefill is computing). The cap never keeps a request behind a running one of a lower tier.
"""

import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from carpool.engine.tiers import BACKGROUND_PRIORITY, BY_NAME, BY_PRIORITY, TIER_NAMES

# Features are scaled to similar magnitudes so one ridge weight means the same for each coefficient.
FEATURE_SCALES = np.array([1.0, 100.0, 10.0, 10_000.0])  # step, tokens, sequences, context tokens
# Prior (seconds per scaled unit): 5 ms a step, 0.3 ms a token (SmolLM2-135M prefill on 2 cores is ~0.25),
# 0.1 ms a sequence, 0.5 us per context token read (23 KB of bf16 KV a token at ~50 GB/s).
PRIOR = np.array([0.005, 0.03, 0.001, 0.005])
PRIOR_WEIGHT = 0.5  # the prior counts as half a step: a few real ones outweigh it
DECAY = 0.98  # memory of ~50 steps: recent load, recent thread contention
ERROR_SIGMAS = 2.0
# The closed loop (TailFeedback).
TAIL_QUANTILE = 0.99  # the SLO's own: the trace bench judges each minute's p99 of the gaps
# Of the SLO; the rest is for what the engine cannot see (event loop, HTTP, the client's read) and for the loop's
# own slack. At 0.9 the trace's peak minutes (quiet machine, 2026-12-01) had an engine-side p99 of 93-98 ms, 3-9% over
# the aim, and the client's p99 3-9 ms above that: 4-5 of 6 minutes within 100 ms.
TAIL_AIM = 0.8
# A window of gaps, not steps, as the SLO counts them; but a step's decodes share its gap, so the window's p99 is
# about its 6th-worst step of ~60 at a 10-user peak (~5 s at 80 ms steps), of ~300 with 2 users (~25 s).
TAIL_WINDOW = 600
TAIL_MIN_GAPS = 100  # before that the open-loop target stands: a p99 of fewer gaps is just their maximum
TAIL_UPDATE_GAPS = 50  # gaps between re-estimates (five steps of a 10-user peak)
# The factor's bounds: 0.5 of the open-loop target still decodes a full batch (a budget of ~40 ms on 2 cores;
# fixed 64-token steps were 0.67x the throughput of 512) when the tail is something no budget can fix; 1.5 lets
# an open-loop target that is too careful grow, but not unboundedly while no step fills the budget.
TARGET_FACTOR_RANGE = (0.5, 1.5)
FINISHED_WEIGHT = 0.05  # live_capacity's mean over finished requests: the last ~20 of them
# Steps before live_capacity is said: the model's error spread still holds the warm-up's first-call steps until
# they decay (0.98^300 = 0.2%); before that the compressed day's first autoscaled replica reported a capacity of 1-2
# for two users and Ray added a second replica within the first slice (2026-12-06 21:00).
CAPACITY_MIN_STEPS = 300


def check_slos(name: str, slos) -> dict[str, float]:
    """{tier: milliseconds} checked: every key a tier, every value a positive number; ValueError naming `name`."""
    if slos is None:
        return {}
    if not isinstance(slos, dict):
        raise ValueError(f"{name} must be a dict of tier -> milliseconds, got {slos!r}")
    for tier, ms in slos.items():
        if tier not in BY_NAME:
            raise ValueError(f"{name}: tier must be one of {', '.join(TIER_NAMES)}, got {tier!r}")
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"{name}[{tier!r}] must be a positive number of milliseconds, got {ms!r}")
    return {tier: float(ms) for tier, ms in slos.items()}


def parse_slo(text: str) -> tuple[str, float]:
    """'TIER=MS' (a serve flag's value) -> (tier, ms); ValueError saying what is wrong."""
    tier, sep, ms = text.partition("=")
    if not sep:
        raise ValueError(f"expected TIER=MS, got {text!r}")
    if tier not in BY_NAME:
        raise ValueError(f"tier must be one of {', '.join(TIER_NAMES)}, got {tier!r}")
    try:
        value = float(ms)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"MS must be a positive number of milliseconds, got {ms!r}")
    return tier, value


@dataclass(frozen=True)
class StepLimits:
    max_tokens: int
    max_seqs: int
    reason: str  # "fixed" (no SLOs), "throughput" (no ITL tier present), "itl" or "ttft"
    tier: str = ""  # the tier whose SLO set the limits, for "itl" and "ttft"
    # Sequences of this priority number or better are admitted past max_seqs (up to the configured slots).
    exempt_priority: int = -1
    # Tokens of max_tokens that only tiers below exempt_priority may use: their prompts always move.
    reserved: int = 0
    # The closed loop's state, for the gauges: the factor on the open-loop step-time target (1: open loop), and
    # the p99 of the realised gaps between the governing tier's tokens over the window (None: no gaps yet).
    target_factor: float = 1.0
    itl_p99: float | None = None


class StepTimeModel:
    """seconds ~ x . theta with x = (1, tokens, sequences, context tokens) / FEATURE_SCALES, by exponentially
    weighted ridge regression toward PRIOR; also the weighted spread of its one-step-ahead errors."""

    def __init__(self):
        self.xtx = np.zeros((4, 4))
        self.xty = np.zeros(4)
        self.error_sq, self.error_weight = 0.0, 0.0
        self.theta = PRIOR.copy()

    def features(self, tokens: float, seqs: float, context: float) -> np.ndarray:
        return np.array([1.0, tokens, seqs, context]) / FEATURE_SCALES

    def predict(self, tokens: float, seqs: float, context: float) -> float:
        return float(self.features(tokens, seqs, context) @ self.theta)

    def observe(self, tokens: int, seqs: int, context: int, seconds: float) -> None:
        x = self.features(tokens, seqs, context)
        error = seconds - float(x @ self.theta)
        self.error_sq = self.error_sq * DECAY + error * error
        self.error_weight = self.error_weight * DECAY + 1.0
        self.xtx = self.xtx * DECAY + np.outer(x, x)
        self.xty = self.xty * DECAY + x * seconds
        ridge = PRIOR_WEIGHT * np.eye(4)
        theta = np.linalg.solve(self.xtx + ridge, self.xty + ridge @ PRIOR)
        self.theta = np.maximum(theta, 0.0)  # no step gets cheaper with more work

    @property
    def error_std(self) -> float:
        return math.sqrt(self.error_sq / self.error_weight) if self.error_weight else 0.0

    def coefficients(self) -> dict[str, float]:
        """Seconds per step, per token, per sequence and per context token."""
        a, b, c, d = self.theta / FEATURE_SCALES
        return {"step": a, "token": b, "sequence": c, "context_token": d}


class TailFeedback:
    """The last TAIL_WINDOW gaps between consecutive tokens of the governing tier's sequences (engine side), and
    each one's ratio to the step-time target of the step that ended it; their p99s, re-estimated every
    TAIL_UPDATE_GAPS gaps."""

    def __init__(self):
        self.gaps: deque[float] = deque(maxlen=TAIL_WINDOW)
        self.ratios: deque[float] = deque(maxlen=TAIL_WINDOW)
        self.gap_p99: float | None = None
        self.ratio_p99: float | None = None  # None until TAIL_MIN_GAPS ratios
        self._fresh = 0

    def observe(self, gap: float, target: float | None) -> None:
        """One gap in seconds; target: the step's target in seconds, None when the target did not size it."""
        self.gaps.append(gap)
        if target is not None:
            self.ratios.append(gap / target)
        self._fresh += 1
        if self._fresh >= TAIL_UPDATE_GAPS or len(self.gaps) < TAIL_MIN_GAPS:
            self._fresh = 0
            self.gap_p99 = float(np.quantile(self.gaps, TAIL_QUANTILE))
            if len(self.ratios) >= TAIL_MIN_GAPS:
                self.ratio_p99 = float(np.quantile(self.ratios, TAIL_QUANTILE))

    def factor(self, aim: float, open_loop_target: float) -> float:
        """What the open-loop target is scaled by so the window's p99 gap lands at `aim` seconds."""
        if self.ratio_p99 is None or self.ratio_p99 <= 0 or open_loop_target <= 0:
            return 1.0
        low, high = TARGET_FACTOR_RANGE
        return min(high, max(low, aim / self.ratio_p99 / open_loop_target))


class SloController:
    def __init__(self, slo_itl_ms: dict[str, float], slo_ttft_ms: dict[str, float], min_chunk: int):
        self.itl = {BY_NAME[tier].priority: ms / 1000 for tier, ms in slo_itl_ms.items()}
        self.ttft = {BY_NAME[tier].priority: ms / 1000 for tier, ms in slo_ttft_ms.items()}
        self.min_chunk = min_chunk
        self.max_tokens = self.max_seqs = 0  # the ceilings, given to every plan()
        self.model = StepTimeModel()
        self.gap = 0.0  # seconds between a step's end and the next one's start while work waits (EW mean)
        self._busy_since: float | None = None
        self.tail = TailFeedback()
        # The step being planned and run: the priority whose ITL governs it, and its step-time target in
        # seconds when that target sized the budget (the gaps its tokens end are measured against it).
        self._step_tier: int | None = None
        self._step_target: float | None = None
        self._context_per_seq = 0.0  # the last planned step's, for live_capacity between steps
        self._prompt_per_output: float | None = None  # live requests' computed prompt tokens per output token (EW)
        self.steps_observed = 0

    def plan(self, running: list, waiting: list, now: float, max_tokens: int, max_seqs: int) -> StepLimits:
        """The next step's limits, at most max_tokens and max_seqs (the flags, read by the caller every step)."""
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        present = {s.priority for s in running + waiting}
        governed = [p for p in present if p in self.itl]
        self._step_tier = self._step_target = None
        if not governed:
            return StepLimits(self.max_tokens, self.max_seqs, "throughput", itl_p99=self.tail.gap_p99)
        tier = min(governed)
        open_loop = self.itl[tier] - self.gap - ERROR_SIGMAS * self.model.error_std
        factor = self.tail.factor(TAIL_AIM * self.itl[tier], open_loop)
        target = factor * open_loop
        decodes = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        context_per_seq = sum(s.num_tokens for s in running) / len(running) if running else 0.0
        self._context_per_seq = context_per_seq or self._context_per_seq
        # A block of the budget is held for lower tiers' prompts, or a steady stream of the governing tier's
        # prompts would take every token of a small budget, step after step.
        lower_prompt = any(s.priority > tier and s.num_tokens - s.num_computed_tokens > 1 for s in running + waiting)
        reserved = self.min_chunk if lower_prompt else 0
        # Every running decode, a block of prompt and the held block, whatever the model says: nothing waits.
        floor = min(self.max_tokens, len(decodes) + self.min_chunk + reserved)
        fit = self._tokens_fitting(target, len(decodes) + 1, context_per_seq * len(running))
        tokens = max(floor, min(self.max_tokens, fit))
        seqs = self._seq_cap(target, context_per_seq, running, waiting, tier)
        self._step_tier = tier
        self._step_target = target if target > 0 and fit >= floor else None
        # The held block never takes the governing tier's own block of prompt: with a budget of one block beyond
        # the decodes, holding it left a running priority prompt with nothing while the lower prompt it was held
        # for waited on that very prompt's blocks (an empty step, forever). Aging still lets lower prompts in.
        reserved = min(reserved, max(0, tokens - len(decodes) - self.min_chunk))
        limits = StepLimits(tokens, seqs, "itl", BY_PRIORITY[tier].name, tier, reserved, factor, self.tail.gap_p99)
        limits = self._meet_ttft(limits, tier, running, waiting, len(decodes), context_per_seq, now)
        if limits.reason == "ttft":
            self._step_target = None  # a step raised past the ITL target on purpose says nothing about it
        return limits

    def live_capacity(self, max_seqs: int) -> int | None:
        """How many live requests this engine carries within the tightest ITL SLO: the decode batch whose step,
        with a block of prompt beside it (so new requests still start), fits the SLO's step-time target at the
        recent context per sequence and the closed loop's factor, where each request also brings its prompt: a
        request of P computed prompt tokens and O output tokens is 1 + P / O tokens a step over its O decode steps
        (EW means of the live tiers' finished requests). Without the prompt's share the trace's 500-token chats
        with 64-token answers counted as one token a step each, a tenth of their work. The autoscaler's per-replica
        target (carpool.server.replicas.autoscaling): the slots alone (64) let ten SmolLM2 chats on one 1-thread
        replica count as a valley while each of their tokens waited 135-560 ms (docs/benchmarks/journal.md, 19:13
        UTC). At most `max_seqs` (the slots), at least 1; None without an ITL SLO, or before CAPACITY_MIN_STEPS
        steps (the autoscaler then sizes by the slots)."""
        if not self.itl or self.steps_observed < CAPACITY_MIN_STEPS:
            return None
        tightest = min(self.itl.values())
        open_loop = tightest - self.gap - ERROR_SIGMAS * self.model.error_std
        target = self.tail.factor(TAIL_AIM * tightest, open_loop) * open_loop
        c = self.model.coefficients()
        tokens_per_step = 1.0 + (self._prompt_per_output or 0.0)
        per_seq = c["token"] * tokens_per_step + c["sequence"] + c["context_token"] * self._context_per_seq
        room = target - c["step"] - self.min_chunk * c["token"]
        fits = int(room / per_seq) if per_seq > 0 else max_seqs
        return max(1, min(max_seqs, fits))

    def observe_finished(self, priority: int, computed_prompt_tokens: int, output_tokens: int) -> None:
        """A request of tier `priority` finished having computed these prompt tokens (cache hits excluded) and
        made these output tokens; the live tiers' (not the Batch API's) feed live_capacity."""
        if priority >= BACKGROUND_PRIORITY or output_tokens <= 0:
            return
        ratio = computed_prompt_tokens / output_tokens
        previous = self._prompt_per_output
        self._prompt_per_output = (
            ratio if previous is None else (1 - FINISHED_WEIGHT) * previous + FINISHED_WEIGHT * ratio
        )

    def _tokens_fitting(self, target: float, seqs: int, context: float) -> int:
        """The most tokens a step of seqs sequences reading context KV tokens may carry within target seconds
        (prompt chunks included: they are tokens of the model's step like any other)."""
        per_token = self.model.coefficients()["token"]
        if per_token <= 0:
            return self.max_tokens
        return int((target - self.model.predict(0, seqs, context)) / per_token)

    def _seq_cap(self, target: float, context_per_seq: float, running: list, waiting: list, tier: int) -> int:
        c = self.model.coefficients()
        per_seq = c["token"] + c["sequence"] + c["context_token"] * context_per_seq
        fits = int((target - c["step"]) / per_seq) if per_seq > 0 else self.max_seqs
        present = running + waiting
        floor = sum(1 for s in present if s.priority <= tier) + any(s.priority > tier for s in present)
        return max(1, min(self.max_seqs, max(fits, floor)))

    def _meet_ttft(
        self,
        limits: StepLimits,
        itl_tier: int,
        running: list,
        waiting: list,
        num_decodes: int,
        context_per_seq: float,
        now: float,
    ) -> StepLimits:
        """Raise the budget to the smallest that prefills every TTFT-bound prompt (tier <= itl_tier) in time."""
        if not self.ttft:
            return limits
        prompts = sorted(
            (s for s in running + waiting if s.num_tokens - s.num_computed_tokens > 1),
            key=lambda s: (s.priority, s.times.arrival),
        )
        needed, ahead, tightest = limits.max_tokens, 0, None
        for seq in prompts:
            ahead += seq.num_tokens - seq.num_computed_tokens
            slo = self.ttft.get(seq.priority)
            if slo is None or seq.priority > itl_tier or seq.times.first_token is not None:
                continue
            left = slo - (now - seq.times.arrival)
            budget = self._smallest_tokens_for(ahead, left, num_decodes, context_per_seq * len(running))
            if budget > needed:
                needed, tightest = budget, seq.priority
        if tightest is None:
            return limits
        return replace(limits, max_tokens=needed, reason="ttft", tier=BY_PRIORITY[tightest].name)

    def _smallest_tokens_for(self, prompt_tokens: int, seconds: float, num_decodes: int, context: float) -> int:
        budget = self.min_chunk
        while budget < self.max_tokens:
            chunk = budget - num_decodes
            if (
                chunk > 0
                and math.ceil(prompt_tokens / chunk) * self.model.predict(budget, num_decodes + 1, context) <= seconds
            ):
                return budget
            budget *= 2
        return self.max_tokens

    def observe(self, tokens: int, seqs: int, context: int, start: float, end: float, work_left: bool) -> None:
        """One step's shape and its start and end (monotonic seconds); work_left: the engine steps again at once."""
        self.model.observe(tokens, seqs, context, end - start)
        self.steps_observed += 1
        if self._busy_since is not None:
            self.gap = 0.9 * self.gap + 0.1 * max(0.0, start - self._busy_since)
        self._busy_since = end if work_left else None

    def observe_gap(self, priority: int, seconds: float) -> None:
        """A sequence of tier `priority` got a token `seconds` after its previous one, in the step just run."""
        if priority == self._step_tier:
            self.tail.observe(seconds, self._step_target)
