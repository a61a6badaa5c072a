"""A discrete-event simulator of N carpool replicas behind the router: what TTFT, ITL, prefix-cache hit rate and
cost per 1M tokens to expect at a scale this machine cannot run (1-64 replicas), from carpool's own measured
step times and the router's own routing code (carpool.server.replicas.routing).

Each replica is modelled as the engine schedules: continuous batching under `max_num_seqs` sequences and a
`max_num_batched_tokens` token budget a step (long prompts chunked), decode sequences first, and a prefix cache of
`num_blocks` blocks (LRU) keyed by the same salted block-hash chain the engine uses; a step lasts
`StepModel.seconds(prefill tokens, decode sequences, context tokens)`, a plane fitted to real engine steps
(`measure_step_model`).
Sessions (a document's questions, a chat's turns) arrive as a Poisson process; a session's next turn is sent
when its previous one finishes, as the replay bench (carpool.bench.replicas) does. `replay` runs recorded requests
instead (`carpool cost whatif`: a ledger's rows, each a prompt length, its block-hash chain, its output tokens and
tier at its arrival time); waiting requests are admitted in tier order (priority first), as the scheduler does.
"""

import heapq
import itertools
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from carpool.bench.serve import latency_summary
from carpool.bench.sessions import Session
from carpool.engine.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.scheduler import aged_priority
from carpool.engine.slo import SloController, StepLimits
from carpool.engine.step_shape import attention_pairs, fit_row
from carpool.engine.tiers import BACKGROUND_PRIORITY, BY_NAME, DEFAULT_TIER
from carpool.server.replicas.routing import PrefixAffinity, ReplicaLoad, make_routing


@dataclass(frozen=True)
class StepModel:
    """Seconds one engine step takes: fixed cost, plus per prompt token computed, plus per decoding sequence, plus
    per token of KV its attention reads (the context of every sequence in the step), plus, for a step that computes
    any prompt, a fixed cost of its own and a cost per query-key pair its prompt chunks' attention computes.
    Without the context term a model fitted on short prompts predicted 33 ms for a 20-sequence step over ~700-token
    documents that took 61 ms (1 thread, SmolLM2): each such sequence reads ~16 MB of KV a step, as much as the
    weights. The last two are what a prefix-cache hit costs: a decode-only step runs every layer in one fused call
    (carpool/kernels/csrc/decode_layer.cpp) while a step with a prompt chunk runs them one by one, and 40 new tokens
    over an 800-token cached prefix compute 40 x 840 query-key pairs, 40 times a decode's; with one base and no
    pair term the whatif of a help line behind an 800-token system prompt put its TTFT p50 at half the real one
    (docs/benchmarks/journal.md, 2026-12-06 09:42).

    `noise`: how far real steps stray from the plane, the standard deviation of log(measured / predicted) over the
    fitted steps; the simulator draws each step's time around the plane with it. Without it the SLO controller
    (which aims two standard deviations of its own model's error under the target) saw no error in the simulated
    steps and planned larger steps than the real one: the help-line day's default-tier TTFT p50 came out 42% under
    the real run's (2026-12-06 12:04)."""

    base: float
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float = 0.0
    per_prefill_step: float = 0.0
    per_prefill_pair: float = 0.0
    noise: float = 0.0

    def seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int = 0, prefill_pairs: int = 0) -> float:
        return (
            self.base
            + self.per_prefill_token * prefill_tokens
            + self.per_decode_seq * decode_seqs
            + self.per_context_token * context_tokens
            + (self.per_prefill_step if prefill_tokens else 0.0)
            + self.per_prefill_pair * prefill_pairs
        )

    def drawn(self, seconds: float, rng: random.Random) -> float:
        """One real-looking step of `seconds` on the plane: log-normally spread by `noise`."""
        return seconds * math.exp(rng.gauss(0.0, self.noise)) if self.noise else seconds

    @classmethod
    def parse(cls, text: str) -> "StepModel":
        """`--step BASE,PER_PREFILL_TOKEN,PER_DECODE_SEQ[,PER_CONTEXT_TOKEN[,PER_PREFILL_STEP[,PER_PREFILL_PAIR
        [,NOISE]]]]`, in seconds (NOISE: the spread of log step times, as `noise`)."""
        values = text.split(",")
        if not 3 <= len(values) <= 7:
            raise ValueError(f"--step: expected 3 to 7 comma-separated numbers, got {text!r}")
        return cls(*(float(value) for value in values))

    @classmethod
    def fit(cls, steps: list[tuple]) -> "StepModel":
        """Least squares over (prefill tokens, decode sequences[, context tokens[, prefill pairs]], seconds) of real
        steps; a step with prefill tokens also pays per_prefill_step. No step gets cheaper with more work: a
        coefficient that comes out negative is fixed at 0 and the others refitted without it, until none is (zeroing
        it after one fit left the rest fitted to its negative share)."""
        if len(steps) < 4:
            raise ValueError("steps: need at least 4 measured steps to fit a step model")
        shapes = [list(step[:-1]) + [0] * (4 - len(step[:-1])) for step in steps]
        rows = np.array([[1.0, p, d, c, 1.0 if p else 0.0, pairs] for p, d, c, pairs in shapes])
        times = np.array([step[-1] for step in steps])
        free = np.ones(rows.shape[1], dtype=bool)
        coefficients = np.zeros(rows.shape[1])
        while free.any():
            fitted, *_ = np.linalg.lstsq(rows[:, free], times, rcond=None)
            coefficients[:] = 0.0
            coefficients[free] = fitted
            if (fitted >= 0).all():
                break
            free[np.flatnonzero(free)[fitted < 0]] = False
        predicted = rows @ coefficients
        fitted_steps = (predicted > 0) & (times > 0)
        noise = float(np.std(np.log(times[fitted_steps] / predicted[fitted_steps]))) if fitted_steps.any() else 0.0
        return cls(*(float(c) for c in coefficients), noise=noise)


@dataclass
class ReplicaSpec:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    num_blocks: int = 4096
    block_size: int = 16
    prefix_caching: bool = True
    # The SLO controller's targets ({tier: ms}, `carpool serve --slo-itl/--slo-ttft`); empty: fixed steps.
    slo_itl_ms: dict = field(default_factory=dict)
    slo_ttft_ms: dict = field(default_factory=dict)
    # Seconds from a request's arrival to when the engine can schedule it that no step explains (`carpool cost
    # whatif` fits it to the recorded rows' own times to first token).
    admission_seconds: float = 0.0
    # The scheduler's aging (carpool.engine.scheduler.aged_priority), the engine's defaults.
    priority_aging_seconds: float = EngineConfig.priority_aging_seconds
    max_priority_boost: int = EngineConfig.max_priority_boost


@dataclass(frozen=True)
class Pool:
    """One model's replicas and what a step of that model costs."""

    replicas: int
    step: StepModel


@dataclass(frozen=True)
class Job:
    """One request to run: when it arrives, its prompt (length, and its full blocks' chain of prefix-cache keys:
    any hashable values, equal where prompts share a prefix), its output tokens and its tier.

    A job may wait for another (`after`, an index into the replayed jobs): it is sent when that one finishes, as a
    compressed prompt follows its scorer's pass, and its latency still counts from `arrival`, the client's. An
    `internal` job (the scorer's pass) takes its steps and is billed, but its latencies are no client's."""

    arrival: float
    prompt_tokens: int
    chain: tuple
    output_tokens: int
    tier: str = DEFAULT_TIER
    after: int | None = None
    internal: bool = False
    # A cache breakpoint (Anthropic's cache_control): its first `pinned_blocks` blocks stay cached `pin_ttl` seconds
    # from their last use, whatever the LRU would evict.
    pinned_blocks: int = 0
    pin_ttl: float = 0.0
    model: int = 0  # which pool of replicas runs it (`replay`'s models: 0 the recorded one, then others)


@dataclass
class SimResult:
    replicas: int
    routing: str
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    makespan: float = 0.0
    # Per tier, and per replayed job (`replay`: its index in the jobs): what a whatif prices and reports.
    ttft_by_tier: dict[str, list[float]] = field(default_factory=dict)
    itl_by_tier: dict[str, list[float]] = field(default_factory=dict)
    cached_by_job: dict[int, int] = field(default_factory=dict)
    ttft_by_job: dict[int, float] = field(default_factory=dict)
    cache_writes_by_job: dict[int, int] = field(default_factory=dict)  # prompt tokens it added to the cache
    pin_writes_by_job: dict[int, int] = field(default_factory=dict)  # of those, the ones under its breakpoint
    finished_by_job: dict[int, float] = field(default_factory=dict)

    def summary(self, hourly_price_per_replica: float) -> dict:
        tokens = self.prompt_tokens + self.output_tokens
        dollars = self.replicas * hourly_price_per_replica * self.makespan / 3600
        return {
            "replicas": self.replicas,
            "routing": self.routing,
            "requests": len(self.ttft),
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            **latency_summary(self.ttft, self.itl),
            "output_tokens_per_s": self.output_tokens / self.makespan if self.makespan else 0.0,
            "usd_per_1m_tokens": dollars / tokens * 1e6 if tokens else 0.0,
            "usd_per_1m_output_tokens": dollars / self.output_tokens * 1e6 if self.output_tokens else 0.0,
        }


@dataclass
class _Seq:
    """A request in a replica; to the SLO controller (which plans from these as from the engine's Sequences) its
    priority, tokens, computed tokens and times."""

    job: Job
    session: int  # a session's index (its next turn follows this one), or -1 for a replayed job
    turn: int  # the turn's index in its session, or the replayed job's index
    replica: int = -1
    admitted: bool = False
    to_prefill: int = 0  # prompt tokens still to compute
    computed_prompt: int = 0  # of the prompt, the tokens it computed at admission (not cache hits)
    produced: int = 0
    last_token_at: float | None = None
    first_token_at: float | None = None

    @property
    def context(self) -> int:
        """Tokens whose KV this sequence's attention reads in its next step (cached and computed ones)."""
        return self.job.prompt_tokens - self.to_prefill + self.produced

    @property
    def priority(self) -> int:
        return BY_NAME[self.job.tier].priority

    @property
    def num_tokens(self) -> int:
        return self.job.prompt_tokens + self.produced

    @property
    def num_computed_tokens(self) -> int:
        """As the engine counts them: a decoding sequence's newest token is computed by its next step."""
        if not self.admitted:
            return 0
        return self.context - 1 if self.produced else self.context

    @property
    def times(self) -> SimpleNamespace:
        return SimpleNamespace(arrival=self.job.arrival, first_token=self.first_token_at)


class _Replica:
    def __init__(self, spec: ReplicaSpec, step: StepModel, seed: int):
        self.spec, self.step = spec, step
        self.rng = random.Random(seed)  # its steps' draws: the same replay, the same times
        self.waiting: list[tuple[int, float, int, _Seq]] = []  # a heap: tier priority, then arrival order
        self.running: list[_Seq] = []
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.pins: dict = {}  # block -> when its breakpoint's pin lapses
        self.busy = False
        # The engine's own controller, fed the simulated steps as the engine feeds it real ones.
        self.slo = (
            SloController(spec.slo_itl_ms, spec.slo_ttft_ms, spec.block_size)
            if spec.slo_itl_ms or spec.slo_ttft_ms
            else None
        )

    def cached_tokens(self, job: Job, now: float) -> int:
        """Leading prompt blocks in the cache (at least the last token is always computed, as in the engine); a
        hit on a breakpoint's blocks renews their pins."""
        hit = 0
        for block in job.chain if self.spec.prefix_caching else ():
            if block not in self.cache:
                break
            self.cache.move_to_end(block)
            if hit < job.pinned_blocks:
                self.pins[block] = now + job.pin_ttl
            hit += 1
        return min(hit * self.spec.block_size, job.prompt_tokens - 1)

    def insert(self, job: Job, num_tokens: int, now: float) -> tuple[int, int]:
        """The prompt's blocks computed so far (the engine caches each full block as its chunk is computed): how
        many of them are new to the cache, outside and under its breakpoint (its writes, as the ledger bills them).
        The LRU evicts the least recently used block whose pin, if any, has lapsed."""
        if not self.spec.prefix_caching:
            return 0, 0
        written = [0, 0]
        for index, block in enumerate(job.chain[: num_tokens // self.spec.block_size]):
            pinned = index < job.pinned_blocks
            written[pinned] += block not in self.cache
            self.cache[block] = None
            self.cache.move_to_end(block)
            if pinned:
                self.pins[block] = now + job.pin_ttl
        while len(self.cache) > self.spec.num_blocks:
            victim = next((block for block in self.cache if self.pins.get(block, now) <= now), None)
            if victim is None:
                break  # every block pinned: the engine bounds pins to a share of the pool, so it never gets here
            del self.cache[victim]
            self.pins.pop(victim, None)
        return written[0], written[1]


def _chain(tokens: list[int], salt: str | None, block_size: int) -> tuple:
    """The salted block-hash chain of a prompt, as the prefix router hashes it (routing.PrefixAffinity)."""
    chain, hashes = hash(("salt", salt)), []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        chain = hash((chain, tuple(tokens[start : start + block_size])))
        hashes.append(chain)
    return tuple(hashes)


def _route(router, job: Job, loads: list[ReplicaLoad]) -> int:
    if isinstance(router, PrefixAffinity):
        return router.choose_hashed(list(job.chain), job.prompt_tokens, job.tier, loads)
    return router.choose(None, loads)  # least loaded or round-robin: the request itself is not read


def simulate(
    sessions: list[Session], arrivals: list[float], replicas: int, routing: str, step: StepModel, spec: ReplicaSpec
) -> SimResult:
    """Run `sessions` (session i starts at arrivals[i]) on `replicas` replicas routed by `routing`."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if len(arrivals) != len(sessions):
        raise ValueError("arrivals: one arrival time per session")
    starts = [(at, (index, 0)) for index, at in enumerate(arrivals)]
    return _run(sessions, starts, (Pool(replicas, step),), routing, spec)


def replay(
    jobs: list[Job],
    replicas: int,
    routing: str,
    step: StepModel,
    spec: ReplicaSpec,
    others: tuple[Pool, ...] = (),
    draw: int = 0,
) -> SimResult:
    """Run recorded requests, each at its own arrival time, on `replicas` replicas routed by `routing`; a job of
    `model` k > 0 on the replicas of others[k - 1] (a cheaper model a router or a cascade sends it to). `draw`
    picks the steps' spread around the plane (the same draw, the same times): `carpool cost whatif` takes the
    median of several."""
    pools = (Pool(replicas, step), *others)
    if min(pool.replicas for pool in pools) < 1:
        raise ValueError("replicas must be at least 1")
    if any(not 0 <= job.model < len(pools) for job in jobs):
        raise ValueError(f"jobs: a job's model must index the {len(pools)} pools")
    starts = [(job.arrival, (-1, index)) for index, job in enumerate(jobs) if job.after is None]
    return _run(jobs, starts, pools, routing, spec, draw)


def _run(
    work: list, starts: list, pools: tuple[Pool, ...], routing: str, spec: ReplicaSpec, draw: int = 0
) -> SimResult:
    """`work`: sessions (a start's payload is (session, turn)) or jobs (payload (-1, job index)). Each pool's
    replicas are routed among by a router of their own; replica i of the run's n draws its steps from seed
    draw * n + i."""
    members = []  # per pool, its replicas' indexes in `nodes`
    nodes: list[_Replica] = []
    count = sum(pool.replicas for pool in pools)
    for pool in pools:
        members.append(list(range(len(nodes), len(nodes) + pool.replicas)))
        nodes += [_Replica(spec, pool.step, seed=draw * count + len(nodes) + i) for i in range(pool.replicas)]
    routers = [make_routing(routing, spec.block_size) for _ in pools]
    loads = [ReplicaLoad(slots=spec.max_num_seqs) for _ in nodes]
    result = SimResult(len(nodes), routing)
    followers: dict[int, list[int]] = {}  # a replayed job's index -> the jobs sent when it finishes
    for index, job in enumerate(work):
        if isinstance(job, Job) and job.after is not None:
            followers.setdefault(job.after, []).append(index)
    events: list = []
    order = itertools.count()
    for at, payload in starts:
        heapq.heappush(events, (at, next(order), "arrive", payload))
    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            session_index, turn_index = payload
            if session_index < 0:
                job = work[turn_index]
            else:
                session = work[session_index]
                turn = session.turns[turn_index]
                chain = _chain(turn.prompt_token_ids, session.salt, spec.block_size)
                job = Job(now, len(turn.prompt_token_ids), chain, turn.output_tokens)
            seq = _Seq(job, session_index, turn_index)
            pool = members[job.model]
            seq.replica = pool[_route(routers[job.model], job, [loads[i] for i in pool])]
            loads[seq.replica].in_flight += 1
            heapq.heappush(events, (now + spec.admission_seconds, next(order), "admit", seq))
        elif kind == "admit":
            seq = payload
            heapq.heappush(nodes[seq.replica].waiting, (BY_NAME[seq.job.tier].priority, now, next(order), seq))
            _start_step(nodes[seq.replica], seq.replica, now, events, order, result)
        else:
            _finish_step(nodes, loads, payload, now, work, followers, events, order, result)
    result.makespan = now - min((at for at, _ in starts), default=0.0)
    return result


def _start_step(node: _Replica, index: int, now: float, events, order, result: SimResult) -> None:
    if node.busy or not (node.waiting or node.running):
        return
    spec = node.spec
    limits = None
    if node.slo is not None:
        waiting = [entry[-1] for entry in node.waiting]
        limits = node.slo.plan(node.running, waiting, now, spec.max_num_batched_tokens, spec.max_num_seqs)
        if limits.reason in ("itl", "ttft"):
            _shed_background(node, limits, order)

    def rank(seq: _Seq) -> tuple[float, float]:
        """The scheduler's order: aged tier, then arrival."""
        aged = aged_priority(seq.priority, now - seq.job.arrival, spec.priority_aging_seconds, spec.max_priority_boost)
        return aged, seq.job.arrival

    # A background tier's decodes sit out any step that computes a foreground tier's prompt, as in the engine.
    foreground_prompt = any(s.priority < BACKGROUND_PRIORITY and s.to_prefill for s in node.running) or any(
        entry[-1].priority < BACKGROUND_PRIORITY for entry in node.waiting
    )
    decoding = [
        seq
        for seq in node.running
        if seq.to_prefill == 0 and not (foreground_prompt and seq.priority >= BACKGROUND_PRIORITY)
    ]
    budget = (limits.max_tokens if limits else spec.max_num_batched_tokens) - len(decoding)
    # The SLO controller's held block: tokens of the budget only a tier below the governing one may use, while one
    # of its prompts can (the scheduler's hold), so a stream of priority prompts cannot take every token.
    exempt = limits.exempt_priority if limits else -1
    lower_prompt = any(s.priority > exempt for s in node.running if s.to_prefill) or any(
        entry[-1].priority > exempt for entry in node.waiting
    )
    held = limits.reserved if limits and lower_prompt else 0
    chunks = []

    def take(seq: _Seq) -> None:
        """seq's chunk of what is left of the budget, the held block kept from the governing tier and above."""
        nonlocal budget, held
        chunk = min(seq.to_prefill, budget - (held if seq.priority <= exempt else 0))
        if chunk > 0:
            chunks.append((seq, chunk))
            budget -= chunk
            if seq.priority > exempt:
                held = max(0, held - chunk)

    # Prompt work, running prompts' next chunks and waiting requests alike, in rank order, as the scheduler does:
    # taking running chunks first left a help-line turn behind every remaining chunk of a document that started
    # first (512-token chunks of ~370 ms each on 2 cores, 2026-12-07).
    running = {id(seq) for seq in node.running}
    entries = {id(entry[-1]): entry for entry in node.waiting}
    prompts = [seq for seq in node.running if seq.to_prefill] + [entry[-1] for entry in node.waiting]
    for seq in sorted(prompts, key=rank):
        if budget <= 0:
            break
        if id(seq) in running:
            take(seq)
            continue
        if len(node.running) >= spec.max_num_seqs:
            continue
        if limits and _capped(seq, limits, node.running, rank):
            continue  # the cap: only a lower tier than the governing one, which waits for the batch to shrink
        if budget - (held if seq.priority <= exempt else 0) <= 0:
            continue  # what is left is held for a lower tier's prompt
        node.waiting.remove(entries[id(seq)])
        seq.admitted = True
        if seq.produced:  # shed for a surge: back with its blocks from the cache, its partial block recomputed
            seq.to_prefill = max(1, (seq.job.prompt_tokens + seq.produced) % spec.block_size)
            node.running.append(seq)
            take(seq)
            continue
        cached = node.cached_tokens(seq.job, now)  # at admission: what earlier chunks have cached by now
        if not seq.computed_prompt:  # its first admission (not again after a shed)
            seq.computed_prompt = seq.job.prompt_tokens - cached
            result.prompt_tokens += seq.job.prompt_tokens
            result.cached_tokens += cached
            if seq.session < 0:
                result.cached_by_job[seq.turn] = cached
        seq.to_prefill = seq.job.prompt_tokens - cached
        node.running.append(seq)
        take(seq)
    heapq.heapify(node.waiting)
    if not chunks and not decoding:
        return
    node.busy = True
    context = sum(seq.context for seq in decoding)
    pairs = sum(attention_pairs(chunk, seq.context) for seq, chunk in chunks)
    duration = node.step.drawn(node.step.seconds(sum(c for _, c in chunks), len(decoding), context, pairs), node.rng)
    # The step's shape as the engine tells its SLO controller: tokens, sequences, KV read (computed before it + new).
    tokens = len(decoding) + sum(c for _, c in chunks)
    read = sum(s.num_computed_tokens for s in decoding) + sum(s.num_computed_tokens for s, _ in chunks) + tokens
    shape = (tokens, len(decoding) + len(chunks), read, now)
    heapq.heappush(events, (now + duration, next(order), "step", (index, decoding, chunks, shape)))


def _shed_background(node: _Replica, limits: StepLimits, order) -> None:
    """The scheduler's surge rule (Scheduler._shed_background): running background (Batch API) sequences beyond
    the SLO's cap, counting the protected tier's waiting ones, go back to waiting, worst first."""
    arriving = sum(1 for entry in node.waiting if entry[-1].priority <= limits.exempt_priority)
    while len(node.running) + arriving > limits.max_seqs:
        background = [seq for seq in node.running if seq.priority >= BACKGROUND_PRIORITY]
        if not background:
            return
        seq = max(background, key=lambda s: (s.priority, s.job.arrival))
        node.running.remove(seq)
        if not seq.produced:  # mid-prompt: it starts again from what its chunks cached
            seq.admitted, seq.to_prefill = False, 0
        heapq.heappush(node.waiting, (seq.priority, seq.job.arrival, next(order), seq))


def _capped(seq: _Seq, limits: StepLimits, running: list[_Seq], rank) -> bool:
    """The scheduler's cap (Scheduler._capped): a lower tier than the governing one is not admitted while the batch
    is at the cap, unless a running sequence ranks lower (aged tier) still."""
    if len(running) < limits.max_seqs or seq.priority <= limits.exempt_priority:
        return False
    return not any(rank(r)[0] > rank(seq)[0] for r in running)


def _finish_step(nodes, loads, payload, now, work, followers, events, order, result: SimResult) -> None:
    index = payload[0]
    node = nodes[index]
    writes, emitted, finished = _advance_step(node, payload, now)
    for seq, written, pinned in writes:
        if seq.session < 0:
            for counts, blocks in ((result.cache_writes_by_job, written), (result.pin_writes_by_job, pinned)):
                if blocks:
                    counts[seq.turn] = counts.get(seq.turn, 0) + blocks * node.spec.block_size
    for seq, gap in emitted:
        result.output_tokens += 1
        if seq.job.internal:
            continue
        if gap is None:  # the prompt's last chunk sampled the first token
            result.ttft.append(now - seq.job.arrival)
            result.ttft_by_tier.setdefault(seq.job.tier, []).append(now - seq.job.arrival)
            if seq.session < 0:
                result.ttft_by_job[seq.turn] = now - seq.job.arrival
        else:
            result.itl.append(gap)
            result.itl_by_tier.setdefault(seq.job.tier, []).append(gap)
    for seq in finished:
        loads[index].in_flight -= 1
        if seq.session < 0:
            result.finished_by_job[seq.turn] = now
            for follower in followers.get(seq.turn, ()):
                heapq.heappush(events, (now, next(order), "arrive", (-1, follower)))
        elif seq.turn + 1 < len(work[seq.session].turns):
            heapq.heappush(events, (now, next(order), "arrive", (seq.session, seq.turn + 1)))
    used = sum(math.ceil(s.job.prompt_tokens / node.spec.block_size) for s in node.running)
    loads[index].kv_usage = min(1.0, used / node.spec.num_blocks)
    _start_step(node, index, now, events, order, result)


def _advance_step(node: _Replica, payload, now: float) -> tuple[list, list, list]:
    """A step of `node` ends at `now`: its prompt chunks computed and cached, a token for each sequence it decoded
    or finished the prompt of, finished sequences out of the replica, the SLO controller fed. Returns what its
    caller records: the cache writes of each chunk (seq, blocks written outside and under its breakpoint), each
    token emitted (seq, seconds since its previous token, None for a first token) and the sequences finished."""
    _, decoding, chunks, (tokens, seqs, read, started) = payload
    node.busy = False
    writes, emitted, finished = [], [], []
    ready = list(decoding)
    for seq, chunk in chunks:
        seq.to_prefill -= chunk
        writes.append((seq, *node.insert(seq.job, seq.job.prompt_tokens - seq.to_prefill, now)))
        if seq.to_prefill == 0:  # the prompt's last chunk samples the first token
            ready.append(seq)
    for seq in ready:
        gap = None if seq.last_token_at is None else now - seq.last_token_at
        if gap is not None and node.slo is not None:
            node.slo.observe_gap(seq.priority, gap)
        emitted.append((seq, gap))
        seq.last_token_at = now
        seq.first_token_at = seq.first_token_at or now
        seq.produced += 1
        if seq.produced >= max(seq.job.output_tokens, 1):
            node.running.remove(seq)
            finished.append(seq)
            if node.slo is not None:
                node.slo.observe_finished(seq.priority, seq.computed_prompt, seq.produced)
    if node.slo is not None:
        node.slo.observe(tokens, seqs, read, started, now, bool(node.running or node.waiting))
    return writes, emitted, finished


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """`count` session start times at `rate` sessions a second (exponential gaps), from 0."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng, at, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(rate)
    return times


def measure_step_model(config, **shapes) -> StepModel:
    """A StepModel fitted to real steps of carpool's engine under `config` (an EngineConfig): `measured_steps`."""
    return StepModel.fit(measured_steps(config, **shapes))


def measured_steps(
    config,
    prompt_lengths=(64, 256, 512),
    batch_sizes=(1, 4, 16, 32),
    contexts=(16, 768),
    hit_suffixes=(32, 128),
    decode_steps=8,
) -> list[tuple[int, int, int, int, float]]:
    """(prompt tokens, decoding sequences, KV tokens the decodes read, prompt chunks' query-key pairs, seconds) of
    real steps of carpool's engine under `config`, warmed up as a server is: prompts alone of several sizes,
    prompts behind a cached prefix of the longest context (what a help line's turns are), then decode batches of
    several sizes over short and long contexts (random token prompts)."""
    from carpool.engine.llm_engine import LLMEngine
    from carpool.engine.warmup import warm_up

    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    steps: list[tuple[int, int, int, int, float]] = []
    ids = itertools.count()

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(count)]

    def run(prompts: list[list[int]], max_tokens: int) -> None:
        for prompt in prompts:
            engine.add_request(
                f"fit-{next(ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            )
        while engine.has_unfinished_requests():
            engine.last_step = None  # a step that scheduled nothing leaves it as it was
            engine.step()
            stats = engine.last_step
            if stats is not None and stats.num_tokens:
                steps.append(fit_row(stats))

    warm_up(engine)  # as a server does before its first request: first-call costs are no step's
    for length in prompt_lengths:
        run([tokens(length)], 1)
    prefix = tokens(max(contexts))
    run([prefix + tokens(1)], 1)  # caches the prefix
    for suffix in hit_suffixes:
        run([prefix + tokens(suffix)], 1)
    for context in contexts:
        for size in batch_sizes:
            run([tokens(context) for _ in range(size)], decode_steps)
    return steps


def add_parser(modes):
    """The `simulate` mode's parser (carpool.bench.simulate_day adds `--day` to it)."""
    parser = modes.add_parser(
        "simulate",
        help="predict TTFT/ITL, hit rate and cost per 1M tokens for 1-64 "
        "replicas from this machine's measured step times",
    )
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument(
        "--replicas",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[1, 2, 4, 8, 16, 32, 64],
        help="replica counts to simulate, comma-separated",
    )
    parser.add_argument(
        "--routing",
        nargs="+",
        default=["prefix", "round-robin"],
        help="routing policies to simulate: prefix, least-loaded, round-robin",
    )
    parser.add_argument("--rate", type=float, default=0.15, help="sessions started a second, per replica")
    parser.add_argument("--meetings", type=int, default=4, help="a replica's worth of traffic: as bench replicas")
    parser.add_argument("--max-doc-words", type=int, default=700, help="skip longer transcripts")
    parser.add_argument("--chats", type=int, default=4, help="multi-turn conversations a replica")
    parser.add_argument("--tenants", type=int, default=3, help="tenants a replica's traffic comes from")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a replica (the fitted step model's)")
    parser.add_argument(
        "--step",
        default=None,
        metavar="BASE,PER_PREFILL_TOKEN,PER_DECODE_SEQ[,PER_CONTEXT_TOKEN[,PER_PREFILL_STEP[,PER_PREFILL_PAIR[,NOISE]]]]",
        help="a step model in seconds instead of fitting one to this machine",
    )
    parser.add_argument("--hourly-price", type=float, default=0.10, help="dollars an hour a replica costs")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens a request")
    parser.add_argument("--num-kv-blocks", type=int, default=ReplicaSpec.num_blocks, help="each replica's KV pool")
    parser.add_argument(
        "--out", default=None, help="where the JSON results go (default: bench-results/simulate.json, -day.json)"
    )
    parser.set_defaults(func=main)
    return parser


def main(args) -> int:
    import json
    from pathlib import Path

    from carpool.bench.sessions import workload
    from carpool.engine.config import EngineConfig
    from carpool.models import Tokenizer
    from carpool.models.loader import resolve_model_dir

    if args.step:
        step = StepModel.parse(args.step)
    else:
        step = measure_step_model(EngineConfig(model=args.model, num_threads=args.threads))
    tokenizer = Tokenizer.from_dir(resolve_model_dir(args.model))
    # One replica's worth of traffic is `carpool bench replicas`' workload; N replicas serve N copies of it, each
    # copy for tenants of its own (other salts: nothing cached is shared across copies), arriving N times as fast.
    # The load per replica stays the same, so what changes with N is routing's reach and the cache's.
    base = workload(tokenizer, args.meetings, args.max_doc_words, args.chats, args.tenants, args.max_tokens)
    rows = []
    for replicas in args.replicas:
        sessions = [
            Session(session.turns, f"{session.salt}-copy{copy}") for copy in range(replicas) for session in base
        ]
        random.Random(replicas).shuffle(sessions)
        arrivals = poisson_arrivals(len(sessions), args.rate * replicas, seed=replicas)
        for routing in args.routing:
            spec = ReplicaSpec(num_blocks=args.num_kv_blocks)
            row = simulate(sessions, arrivals, replicas, routing, step, spec).summary(args.hourly_price)
            rows.append(row)
            print(
                f"{replicas:>3} replicas {routing:<13} hit {row['hit_rate']:.2f}  TTFT p50 "
                f"{row['ttft_p50_s'] * 1e3:7.0f} ms p99 {row['ttft_p99_s'] * 1e3:7.0f} ms  ITL p50 "
                f"{row['itl_p50_s'] * 1e3:5.1f} ms  ${row['usd_per_1m_tokens']:.3f}/1M tokens",
                flush=True,
            )
    out = Path(args.out or "bench-results/simulate.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"step_model": vars(step), "rate_per_replica": args.rate, "rows": rows}, indent=2) + "\n")
    print(f"step model {step}; wrote {out}")
    return 0
