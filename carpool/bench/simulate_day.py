"""`carpool bench simulate --day`: `carpool bench trace`'s compressed day on a replica set that changes over time,
fixed MIN, fixed MAX, autoscaled MIN:MAX and autoscaled with a pre-warm plan side by side, at K times the real
bench's scale (1:2 replicas become K:2K), from the simulator's replicas (carpool.bench.simulate: the engine's
scheduling and SLO controller over a measured step model).

The day, as the trace runs it: priority chat users, closed loop (a user's next request is sent when its previous
one ends), their count per slice of `slice_seconds`; a Batch API job submitted at the start (or at `--batch-at`),
by default with more lines than any configuration finishes, of which the Batch API keeps at most as many in
flight as the server's router has slots (carpool.server.batch.service): MAX x max_num_seqs (fixed: its
replicas', autoscaled: MAX's, carpool.server.replicas.autoscaled). Requests land on replicas as Ray Serve's router places them
(power of two choices on ongoing requests, among the replicas that are up and not draining).

The autoscaler is carpool's policy (carpool.server.replicas.autoscaling: `policy`, and `PlannedPolicy` with a plan
file) called as Ray Serve's controller calls it, with Ray's own rules around it mirrored from
ray/serve/autoscaling_policy.py and ray/serve/_private/autoscaling_state.py (Ray 2.x as installed):
- every `metrics_interval_s` the controller asks the policy; the replicas' ongoing requests and custom metrics
  (Batch lines, live capacity) are averaged over the `look_back_period_s` window (here: samples taken at each
  tick, of the replicas that are up and not draining, as Ray aggregates over its running replicas);
- the policy's float answer goes through the scaling factors (1: ceil, `_apply_scaling_factors`), then the delays
  (`_apply_delay_logic`: a change against the current target happens once the wish to move in that direction has
  held `upscale_delay_s` / `downscale_delay_s`, the clock reset when the direction flips or the wish matches the
  target; a downscale never below 1), then the MIN..MAX bounds (`apply_bounds`);
- a replica added takes traffic `replica_start_seconds` after the decision (its process, model load and warm-up);
  a replica removed is, of those starting, the newest (it carries nothing), else the newest up one, which takes no
  new requests and finishes those it holds (Serve's graceful shutdown) before it stops. A replica costs from the
  decision that starts it until it stops.

The pre-warmed run's plan is yesterday's day: the reactive run's most replicas wanted in each slice, its floor
applied by `PlannedPolicy` itself (the policy's answer or the floor, whichever is more, through Ray's rules).
"""

import heapq
import itertools
import json
import math
import random
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from carpool.bench import simulate
from carpool.bench.serve import percentile
from carpool.bench.simulate import (
    Job,
    ReplicaSpec,
    SimResult,
    StepModel,
    _advance_step,
    _chain,
    _Replica,
    _Seq,
    _start_step,
)
from carpool.engine.tiers import BY_NAME
from carpool.server.replicas.autoscaling import BATCH_ONGOING, LIVE_CAPACITY, PlannedPolicy, policy

PRIORITY, BATCH = "priority", "batch"
# Ray's tolerance for elapsed-time comparisons in its delay logic (`_DELAY_ELAPSED_EPS_S`).
DELAY_EPS = 1e-6


@dataclass(frozen=True)
class DayTraffic:
    """The day: priority users per slice, the prompt lengths requests take in turn (the trace's prompts, one tag
    counter for batch lines and chats alike), and the Batch job."""

    users: tuple[int, ...]
    slice_seconds: float
    prompts: tuple[int, ...]
    # Prefix-cache keys of the full blocks every prompt shares (the chat template's header, before the trace's
    # unique tag); each prompt's other blocks are its own.
    header: tuple = ()
    chat_max_tokens: int = 64
    batch_lines: int = 0
    batch_max_tokens: int = 128
    batch_at: int = 0  # the slice the Batch job arrives at (`carpool bench trace --batch-at`)

    @property
    def seconds(self) -> float:
        return len(self.users) * self.slice_seconds


@dataclass(frozen=True)
class Scaling:
    """One configuration: MIN..MAX replicas (fixed when equal), Ray's autoscaling settings as carpool's autoscaled
    deployment sets them (carpool.server.replicas.replica.autoscaled_deployment), and a pre-warm plan (a `carpool
    capacity plan --format json` document) or None."""

    name: str
    min_replicas: int
    max_replicas: int
    plan: dict | None = None
    replica_start_seconds: float = 10.0
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 20.0
    metrics_interval_s: float = 1.0
    look_back_period_s: float = 5.0

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas > self.min_replicas


@dataclass
class ReplicaLife:
    """When a replica was decided on (it costs from then), took traffic, was removed and stopped (None: not)."""

    decided: float
    up: float | None = None
    removed: float | None = None
    stopped: float | None = None
    held_at_removal: int = 0  # requests it was holding when it was removed (it finishes them)


@dataclass
class DayResult:
    scaling: Scaling
    traffic: DayTraffic
    lives: list[ReplicaLife] = field(default_factory=list)
    decisions: list[tuple[float, int]] = field(default_factory=list)  # (when, target replicas) changes
    itl: list[list[float]] = field(default_factory=list)  # per slice, priority gaps between tokens (s)
    ttft: list[list[float]] = field(default_factory=list)  # per slice, priority times to first token (s)
    tokens: list[int] = field(default_factory=list)  # per slice, output tokens of every tier
    priority_tokens: list[int] = field(default_factory=list)
    batch_done: list[int] = field(default_factory=list)  # per slice, Batch lines completed
    # Per slice, the live capacity each replica reported at the control loop's ticks (what the policy divides by).
    capacity: list[list[int]] = field(default_factory=list)
    sent: int = 0
    finished: int = 0
    held: int = 0  # requests still on a replica (up or draining) at the day's end
    sim: SimResult = field(default_factory=lambda: SimResult(0, "power-of-two"))

    def replica_seconds(self, begin: float, end: float, serving: bool = False) -> float:
        """Replica time within [begin, end): from decision (or, `serving`, from taking traffic) to stop (or
        removal)."""
        total = 0.0
        for life in self.lives:
            start = life.up if serving else life.decided
            stop = (life.removed if serving else None) or life.stopped
            if start is None:
                continue
            total += max(0.0, min(end, self.traffic.seconds if stop is None else stop) - max(begin, start))
        return total

    def peak_target(self, index: int) -> int:
        """The most replicas the autoscaler wanted at once in slice `index` (its decisions, before start times)."""
        begin, end = index * self.traffic.slice_seconds, (index + 1) * self.traffic.slice_seconds
        initial = self.scaling.min_replicas if self.scaling.autoscaled else self.scaling.max_replicas
        at_begin = next((target for at, target in reversed(self.decisions) if at <= begin), initial)
        return max([at_begin] + [target for at, target in self.decisions if begin < at < end])

    def report(self, slo_itl_ms: float, slo_ttft_ms: float, hourly_price: float) -> dict:
        slice_s = self.traffic.slice_seconds
        slices = []
        for index, users in enumerate(self.traffic.users):
            begin, end = index * slice_s, (index + 1) * slice_s
            itl = [gap * 1000 for gap in self.itl[index]]
            ttft = [t * 1000 for t in self.ttft[index]]
            itl_p99, ttft_p99 = percentile(itl, 99), percentile(ttft, 99)
            met = None
            if itl_p99 is not None or ttft_p99 is not None:
                met = (itl_p99 is None or itl_p99 <= slo_itl_ms) and (ttft_p99 is None or ttft_p99 <= slo_ttft_ms)
            slices.append(
                {
                    "index": index,
                    "users": users,
                    "replicas": self.replica_seconds(begin, end) / slice_s,
                    "serving_replicas": self.replica_seconds(begin, end, serving=True) / slice_s,
                    "peak_target_replicas": self.peak_target(index),
                    "itl_p50_ms": percentile(itl, 50),
                    "itl_p99_ms": itl_p99,
                    "ttft_p50_ms": percentile(ttft, 50),
                    "ttft_p99_ms": ttft_p99,
                    "within_slo": met,
                    "output_tokens_per_s": self.tokens[index] / slice_s,
                    "priority_tokens_per_s": self.priority_tokens[index] / slice_s,
                    "batch_lines_completed": self.batch_done[index],
                    "live_capacity": sum(self.capacity[index]) / len(self.capacity[index])
                    if self.capacity[index]
                    else None,
                }
            )
        seconds = self.replica_seconds(0.0, self.traffic.seconds)
        capacities = [c for reported in self.capacity for c in reported]
        # Slices with users, as the trace's summary judges them (a slice after the last user has only the tail of
        # requests sent before it).
        judged = [s for s in slices if s["users"] and s["within_slo"] is not None]
        return {
            "name": self.scaling.name,
            "min_replicas": self.scaling.min_replicas,
            "max_replicas": self.scaling.max_replicas,
            "autoscaled": self.scaling.autoscaled,
            "planned": self.scaling.plan is not None,
            "replica_minutes": seconds / 60,
            "usd": seconds / 3600 * hourly_price,
            "slices_within_slo": sum(s["within_slo"] for s in judged),
            "slices_judged": len(judged),
            "batch_lines_completed": sum(self.batch_done),
            "output_tokens": sum(self.tokens),
            "mean_live_capacity": sum(capacities) / len(capacities) if capacities else None,
            "prefix_hit_rate": self.sim.cached_tokens / self.sim.prompt_tokens if self.sim.prompt_tokens else 0.0,
            "requests_sent": self.sent,
            "requests_finished": self.finished,
            "decisions": self.decisions,
            "slices": slices,
        }


def power_of_two(serving: list[int], ongoing: list[int], rng: random.Random) -> int:
    """Ray Serve's router: two replicas at random, the one with fewer ongoing requests (the first on a tie)."""
    if len(serving) == 1:
        return serving[0]
    first, second = rng.sample(serving, 2)
    return second if ongoing[second] < ongoing[first] else first


def plan_from(result: DayResult, lead_seconds: float) -> dict:
    """Yesterday's day as a pre-warm plan: the most replicas `result`'s autoscaler wanted in each slice (what the
    minute's demand asked for; the replicas taking traffic lag it by the start time, and a plan of those asked for
    the peak's replicas a minute late), in the shape of `carpool capacity plan --format json` with the slice as its
    minute. `lead_seconds`: how long before a minute its count is raised (the plan's replica_start_seconds)."""
    slice_s = result.traffic.slice_seconds
    return {
        "minutes": [
            {"at": index * slice_s, "replicas": result.peak_target(index)} for index in range(len(result.traffic.users))
        ],
        "replica_start_seconds": lead_seconds,
        "minute_seconds": slice_s,
    }


def run_day(traffic: DayTraffic, scaling: Scaling, step: StepModel, spec: ReplicaSpec, seed: int = 0) -> DayResult:
    """The day on one configuration, until `traffic.seconds` (the trace stops its users and cancels the batch
    then; what replicas still hold is counted in `held`)."""
    if scaling.min_replicas < 1 or scaling.max_replicas < scaling.min_replicas:
        raise ValueError(f"replicas: need 1 <= MIN <= MAX, got {scaling.min_replicas}:{scaling.max_replicas}")
    if scaling.plan is None:
        return _Day(traffic, scaling, step, spec, seed, policy).run()
    with tempfile.TemporaryDirectory(prefix="carpool-simulate-day-") as home:
        path = Path(home) / "plan.json"
        path.write_text(json.dumps(scaling.plan))
        return _Day(traffic, scaling, step, spec, seed, PlannedPolicy(str(path))).run()


class _Day:
    def __init__(self, traffic, scaling, step, spec, seed, autoscaling_policy):
        self.traffic, self.scaling, self.step, self.spec = traffic, scaling, step, spec
        self.policy = autoscaling_policy
        self.rng = random.Random(seed)
        self.seed = seed
        self.result = DayResult(scaling, traffic)
        slices = len(traffic.users)
        self.result.itl, self.result.ttft = [[] for _ in range(slices)], [[] for _ in range(slices)]
        self.result.tokens, self.result.priority_tokens = [0] * slices, [0] * slices
        self.result.batch_done = [0] * slices
        self.result.capacity = [[] for _ in range(slices)]
        self.nodes: list[_Replica] = []
        self.ongoing: list[int] = []  # per replica: requests it holds (Ray's ongoing count)
        self.batch_ongoing: list[int] = []
        self.serving: list[int] = []  # replicas up and not draining, in start order
        self.starting: list[int] = []
        self.target = scaling.min_replicas
        self.direction, self.since = 0, None  # Ray's delay state: the wish's direction and since when
        self.samples: deque = deque()  # (time, {replica: (ongoing, batch ongoing, live capacity or None)})
        self.events: list = []
        self.order = itertools.count()
        self.tags = itertools.count()
        self.users_now = 0
        self.busy: set[int] = set()  # users with a request in flight
        self.batch_sent = 0

    def run(self) -> DayResult:
        for _ in range(self.scaling.min_replicas if self.scaling.autoscaled else self.scaling.max_replicas):
            self._up(self._add(0.0), 0.0)  # the trace starts on a healthy server: its first replicas are warm
        for index in range(len(self.traffic.users)):
            self._push(index * self.traffic.slice_seconds, "slice", index)
        self._push(self.scaling.metrics_interval_s, "tick", None)  # fixed replicas report too (nothing acts on it)
        self._push(self.traffic.batch_at * self.traffic.slice_seconds, "batch", None)
        end = self.traffic.seconds
        while self.events and self.events[0][0] < end:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "step":
                self._step_done(payload, now)
            elif kind == "admit":
                index, seq = payload
                heapq.heappush(self.nodes[index].waiting, (BY_NAME[seq.job.tier].priority, now, next(self.order), seq))
                _start_step(self.nodes[index], index, now, self.events, self.order, self.result.sim)
            elif kind == "slice":
                self.users_now = self.traffic.users[payload]
                for user in range(self.users_now):
                    if user not in self.busy:
                        self._send(now, PRIORITY, user)
            elif kind == "batch":
                for _ in range(min(self.traffic.batch_lines, self.scaling.max_replicas * self.spec.max_num_seqs)):
                    self._send(now, BATCH, -1)
            elif kind == "tick":
                self._tick(now)
                self._push(now + self.scaling.metrics_interval_s, "tick", None)
            elif kind == "up" and payload in self.starting:
                self._up(payload, now)
        self.result.held = sum(
            self.ongoing[index] for index, life in enumerate(self.result.lives) if life.stopped is None
        )
        return self.result

    def _push(self, at: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (at, next(self.order), kind, payload))

    def _add(self, now: float) -> int:
        index = len(self.nodes)
        self.nodes.append(_Replica(self.spec, self.step, seed=self.seed * 100_003 + index))
        self.ongoing.append(0)
        self.batch_ongoing.append(0)
        self.result.lives.append(ReplicaLife(decided=now))
        self.starting.append(index)
        return index

    def _up(self, index: int, now: float) -> None:
        self.starting.remove(index)
        self.serving.append(index)
        self.result.lives[index].up = now

    def _send(self, now: float, tier: str, user: int) -> None:
        tag = next(self.tags)
        length = self.traffic.prompts[tag % len(self.traffic.prompts)]
        blocks = length // self.spec.block_size
        shared = self.traffic.header[:blocks]
        chain = shared + tuple((tag, block) for block in range(len(shared), blocks))  # tagged: the rest is its own
        tokens = self.traffic.batch_max_tokens if tier == BATCH else self.traffic.chat_max_tokens
        seq = _Seq(Job(now, length, chain, tokens, tier), session=max(user, 0), turn=tag)
        index = power_of_two(self.serving, self.ongoing, self.rng)
        seq.replica = index
        self.ongoing[index] += 1
        if tier == BATCH:
            self.batch_ongoing[index] += 1
            self.batch_sent += 1
        else:
            self.busy.add(user)
        self.result.sent += 1
        self._push(now + self.spec.admission_seconds, "admit", (index, seq))

    def _step_done(self, payload, now: float) -> None:
        index = payload[0]
        node = self.nodes[index]
        _, emitted, finished = _advance_step(node, payload, now)
        slot = min(int(now // self.traffic.slice_seconds), len(self.traffic.users) - 1)
        result = self.result
        result.tokens[slot] += len(emitted)
        for seq, gap in emitted:
            if seq.job.tier != PRIORITY:
                continue
            result.priority_tokens[slot] += 1
            if gap is None:
                result.ttft[slot].append(now - seq.job.arrival)
            else:
                result.itl[slot].append(gap)
        for seq in finished:
            self.ongoing[index] -= 1
            result.finished += 1
            if seq.job.tier == BATCH:
                self.batch_ongoing[index] -= 1
                result.batch_done[slot] += 1
                if self.batch_sent < self.traffic.batch_lines:
                    self._send(now, BATCH, -1)
            else:
                self.busy.discard(seq.session)
                if seq.session < self.users_now:  # closed loop: the user's next request, while it is still in
                    self._send(now, PRIORITY, seq.session)
        life = result.lives[index]
        if life.removed is not None and self.ongoing[index] == 0:
            life.stopped = now  # drained
        _start_step(node, index, now, self.events, self.order, result.sim)

    def _tick(self, now: float) -> None:
        """One pass of Ray Serve's control loop: sample, average over the look-back window, ask the policy, apply
        Ray's scaling factor, delays and bounds, and start or remove replicas."""
        scaling = self.scaling
        sample = {}
        for index in self.serving:
            slo = self.nodes[index].slo
            capacity = slo.live_capacity(self.spec.max_num_seqs) if slo is not None else None
            sample[index] = (self.ongoing[index], self.batch_ongoing[index], capacity)
        slot = min(int(now // self.traffic.slice_seconds), len(self.traffic.users) - 1)
        self.result.capacity[slot] += [c for _, _, c in sample.values() if c is not None]
        if not scaling.autoscaled:
            return
        self.samples.append((now, sample))
        while self.samples[0][0] <= now - scaling.look_back_period_s:
            self.samples.popleft()
        windows = [s for _, s in self.samples]
        batch, capacity = {}, {}
        for index in self.serving:
            reported = [w[index] for w in windows if index in w]
            batch[index] = sum(r[1] for r in reported) / len(reported)
            capacities = [r[2] for r in reported if r[2] is not None]
            if capacities:
                capacity[index] = sum(capacities) / len(capacities)
        context = SimpleNamespace(
            current_num_replicas=len(self.serving),
            target_num_replicas=self.target,
            total_num_requests=sum(sum(r[0] for r in w.values()) for w in windows) / len(windows),
            aggregated_metrics={BATCH_ONGOING: batch, **({LIVE_CAPACITY: capacity} if capacity else {})},
            config=SimpleNamespace(
                get_target_ongoing_requests=lambda: self.spec.max_num_seqs,
                upscale_delay_s=self.scaling.upscale_delay_s,
                metrics_interval_s=self.scaling.metrics_interval_s,
            ),
            capacity_adjusted_min_replicas=scaling.min_replicas,
            current_time=now,
        )
        desired, _ = self.policy(context)
        decided = min(scaling.max_replicas, max(scaling.min_replicas, self._delayed(math.ceil(desired), now)))
        if decided != self.target:
            self.target = decided
            self.result.decisions.append((now, decided))
            self._resize(now)

    def _delayed(self, desired: int, now: float) -> int:
        """Ray's `_apply_delay_logic`: the target moves to `desired` once the wish to move that way has held its
        delay."""
        if desired == self.target:
            self.direction, self.since = 0, None
            return self.target
        direction = 1 if desired > self.target else -1
        if direction != self.direction:
            self.direction, self.since = direction, now
        delay = self.scaling.upscale_delay_s if direction > 0 else self.scaling.downscale_delay_s
        if now - self.since + DELAY_EPS >= delay:
            self.direction, self.since = 0, None
            return max(1, desired)
        return self.target

    def _resize(self, now: float) -> None:
        while len(self.serving) + len(self.starting) < self.target:
            index = self._add(now)
            self._push(now + self.scaling.replica_start_seconds, "up", index)
        while len(self.serving) + len(self.starting) > self.target:
            if self.starting:
                index = self.starting.pop()
                self.result.lives[index].stopped = now  # never took traffic
                continue
            index = self.serving.pop()
            life = self.result.lives[index]
            life.removed, life.held_at_removal = now, self.ongoing[index]
            if self.ongoing[index] == 0:
                life.stopped = now


def configurations(minimum: int, maximum: int, start_seconds: float, down_delay: float) -> list[Scaling]:
    """Fixed MIN, fixed MAX and autoscaled MIN:MAX (the pre-warmed run is planned from the autoscaled one's)."""
    return [
        Scaling(f"fixed-{minimum}", minimum, minimum),
        Scaling(f"fixed-{maximum}", maximum, maximum),
        Scaling(f"autoscaled-{minimum}:{maximum}", minimum, maximum, None, start_seconds, downscale_delay_s=down_delay),
    ]


def run_configurations(
    traffic: DayTraffic, scalings: list[Scaling], step: StepModel, spec: ReplicaSpec, seed: int = 0
) -> list[DayResult]:
    """Each configuration's day, then the last one (autoscaled) again with its own day as the pre-warm plan, whose
    lead is the replica's start time (PlannedPolicy reads the floor Ray's upscale delay and a tick further ahead)."""
    results = [run_day(traffic, scaling, step, spec, seed) for scaling in scalings]
    reactive = scalings[-1]
    lead = reactive.replica_start_seconds
    planned = Scaling(
        f"{reactive.name}+plan",
        reactive.min_replicas,
        reactive.max_replicas,
        plan_from(results[-1], lead),
        reactive.replica_start_seconds,
        reactive.upscale_delay_s,
        reactive.downscale_delay_s,
        reactive.metrics_interval_s,
        reactive.look_back_period_s,
    )
    return [*results, run_day(traffic, planned, step, spec, seed)]


def trace_prompts(tokenizer, block_size: int) -> tuple[tuple[int, ...], tuple]:
    """The trace's prompts as the server sees them (chat template, the trace's `[tag] ` before each), as token
    counts, and the prefix-cache keys of the full blocks they all share (the template's header up to the tag)."""
    from carpool.bench.datasets import first_human_turns

    texts = first_human_turns(max_chars=2000)
    encoded = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": f"[{tag}] {text}"}]))
        for tag, text in enumerate(texts)
    ]
    common = next(
        (i for i, pair in enumerate(zip(encoded[0], encoded[1])) if pair[0] != pair[1]),
        min(len(encoded[0]), len(encoded[1])),
    )
    return tuple(len(tokens) for tokens in encoded), _chain(encoded[0][:common], None, block_size)


def add_parser(modes) -> None:
    """`carpool bench simulate`, with `--day` added: the mode's parser is simulate's, `--day` runs this one."""
    parser = simulate.add_parser(modes)
    add_arguments(parser)
    parser.set_defaults(func=lambda args: main(args) if args.day else simulate.main(args))


def add_arguments(parser) -> None:
    day = parser.add_argument_group(
        "--day: the compressed day of `carpool bench trace` on fixed and autoscaled replicas"
    )
    day.add_argument(
        "--day",
        action="store_true",
        help="simulate the trace's day on fixed MIN, fixed MAX, autoscaled MIN:MAX and autoscaled + pre-warm "
        "replicas (MIN:MAX = the real bench's 1:2 times --scale)",
    )
    day.add_argument("--scale", type=int, default=32, help="K: replicas K:2K, users and batch lines x K (default 32)")
    day.add_argument("--users", default=None, help="priority users per slice at K=1 (default: the trace's)")
    day.add_argument("--slice-seconds", type=float, default=20.0, help="one scaled 'minute' (default: 20)")
    day.add_argument("--chat-max-tokens", type=int, default=64, help="output tokens per chat request")
    day.add_argument("--batch-max-tokens", type=int, default=128, help="output tokens per batch line")
    day.add_argument("--batch-lines", type=int, default=3000, help="batch lines at K=1, x K (default: 3000)")
    day.add_argument("--batch-at", type=int, default=0, metavar="SLICE", help="the slice the batch job arrives at")
    day.add_argument("--slo-itl-ms", type=float, default=100.0, help="priority ITL SLO, each replica's (default 100)")
    day.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="priority TTFT p99 a slice must meet")
    day.add_argument("--max-num-seqs", type=int, default=64, help="each replica's slots (default: 64)")
    day.add_argument("--max-num-batched-tokens", type=int, default=512, help="each replica's step budget")
    day.add_argument(
        "--replica-start-seconds",
        type=float,
        default=10.0,
        help="from the autoscaler's decision to a new replica taking traffic: the measured start time (10 s: "
        "a 1-thread SmolLM2 replica, process, load and warm-up, docs/benchmarks/journal.md 2026-12-06 19:13)",
    )
    day.add_argument("--scale-down-delay", type=float, default=20.0, help="`carpool serve --scale-down-delay`")
    day.add_argument("--seed", type=int, default=0, help="routing and step-time draws")
    day.add_argument("--plot", default="bench-results/simulate-day.png", help="replicas and ITL p99 per slice")


def main(args) -> int:
    import time

    from carpool.bench.trace import DEFAULT_USERS, parse_users
    from carpool.engine.config import EngineConfig
    from carpool.models import Tokenizer
    from carpool.models.loader import resolve_model_dir

    scale = args.scale
    users = parse_users(args.users) if args.users else list(DEFAULT_USERS)
    for name in ("scale", "slice_seconds", "chat_max_tokens", "batch_max_tokens", "slo_itl_ms", "slo_ttft_ms"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    began = time.monotonic()
    if args.step:
        step = StepModel.parse(args.step)
    else:
        step = simulate.measure_step_model(EngineConfig(model=args.model, num_threads=args.threads))
    spec = ReplicaSpec(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_kv_blocks,
        slo_itl_ms={PRIORITY: args.slo_itl_ms},
    )
    prompts, header = trace_prompts(Tokenizer.from_dir(resolve_model_dir(args.model)), spec.block_size)
    traffic = DayTraffic(
        users=tuple(u * scale for u in users),
        slice_seconds=args.slice_seconds,
        prompts=prompts,
        header=header,
        chat_max_tokens=args.chat_max_tokens,
        batch_lines=args.batch_lines * scale,
        batch_max_tokens=args.batch_max_tokens,
        batch_at=args.batch_at,
    )
    if not 0 <= args.batch_at < len(users):
        raise ValueError(f"--batch-at: a slice of the day, 0 to {len(users) - 1}, got {args.batch_at}")
    scalings = configurations(scale, 2 * scale, args.replica_start_seconds, args.scale_down_delay)
    results = run_configurations(traffic, scalings, step, spec, args.seed)
    runs = [r.report(args.slo_itl_ms, args.slo_ttft_ms, args.hourly_price) for r in results]
    print(comparison_table(runs, args.slo_itl_ms, args.slo_ttft_ms))
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": args.model,
        "scale": scale,
        "step_model": vars(step),
        "users": list(traffic.users),
        "slice_seconds": args.slice_seconds,
        "slo_itl_ms": args.slo_itl_ms,
        "slo_ttft_ms": args.slo_ttft_ms,
        "hourly_price": args.hourly_price,
        "replica_start_seconds": args.replica_start_seconds,
        "scale_down_delay": args.scale_down_delay,
        "batch_lines": traffic.batch_lines,
        "batch_at": traffic.batch_at,
        "plan": results[-1].scaling.plan,
        "runs": runs,
        "seconds_taken": time.monotonic() - began,
    }
    out = Path(args.out or "bench-results/simulate-day.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(runs, report, Path(args.plot))
    print(
        f"step model {step}; {report['seconds_taken']:.0f} s; wrote {out}" + (f" and {args.plot}" if args.plot else "")
    )
    return 0


def comparison_table(runs: list[dict], slo_itl_ms: float, slo_ttft_ms: float) -> str:
    """A summary row per configuration, then each slice side by side: mean replicas, priority ITL p99 / TTFT p99
    (ms) and whether the slice met both SLOs."""

    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    header = f"{'configuration':<22}{'replica-min':>12}{'$':>8}{'slices in SLO':>15}{'batch lines':>13}{'out tok':>10}"
    lines = [header + f"{'live capacity':>15}"]
    for run in runs:
        lines.append(
            f"{run['name']:<22}{run['replica_minutes']:>12.1f}{run['usd']:>8.3f}"
            f"{run['slices_within_slo']:>11}/{run['slices_judged']:<3}{run['batch_lines_completed']:>13}"
            f"{run['output_tokens']:>10}{ms(run['mean_live_capacity']):>15}"
        )
    lines.append(f"per slice: mean replicas, priority ITL p99 / TTFT p99 ms (SLO {slo_itl_ms:g} / {slo_ttft_ms:g})")
    lines.append(f"{'min':>3}{'users':>6}" + "".join(f"  {run['name']:>26}" for run in runs))
    for index, row in enumerate(runs[0]["slices"]):
        cells = []
        for run in runs:
            s = run["slices"][index]
            verdict = {None: " ", True: "ok", False: "X"}[s["within_slo"]]
            cells.append(f"{s['replicas']:>6.1f} {ms(s['itl_p99_ms']):>5}/{ms(s['ttft_p99_ms']):>6} {verdict:>2}")
        lines.append(f"{index:>3}{row['users']:>6}" + "".join(f"  {cell:>26}" for cell in cells))
    lines.append(f"{'':>9}" + "".join(f"  {'batch lines done':>16}{run['batch_lines_completed']:>10}" for run in runs))
    return "\n".join(lines)


def plot(runs: list[dict], report: dict, path: Path) -> None:
    """Replicas (mean per slice) and priority ITL p99 per slice, the four configurations on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (replicas, itl) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for number, run in enumerate(runs):
        x = [s["index"] for s in run["slices"]]
        label = f"{run['name']} ({run['replica_minutes']:.0f} replica-min)"
        replicas.step(x, [s["replicas"] for s in run["slices"]], where="mid", color=f"C{number}", label=label)
        itl.plot(
            x,
            [math.nan if s["itl_p99_ms"] is None else s["itl_p99_ms"] for s in run["slices"]],
            marker="o",
            color=f"C{number}",
            label=run["name"],
        )
    itl.axhline(report["slo_itl_ms"], linestyle="--", color="k", label=f"SLO {report['slo_itl_ms']:g} ms")
    replicas.set_ylim(bottom=0)
    replicas.set(ylabel="replicas (mean in slice)", title=f"the trace's day at K={report['scale']} (simulated)")
    itl.set(
        ylabel="priority ITL p99, ms (log)",
        yscale="log",
        xlabel=f"minute of the day (1 minute = {report['slice_seconds']:g} s)",
    )
    for axis in (replicas, itl):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
