"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`). Running decodes are served first (one token each),
so a long prompt never freezes other streams; then prompt work, running prompts' next chunks and waiting
requests' admissions alike, in rank order: best aged tier first (`aged_priority`), first-come-first-served within
a tier. When blocks or sequence slots run
out, the running sequence with the worst (tier, arrival) is preempted by recompute and goes back to the
waiting queue with its original arrival, so it keeps its place. With SLOs set, a controller (carpool.engine.slo)
sizes each step's token budget and caps admissions below `max_num_seqs` from measured step times.
"""

import time
from dataclasses import dataclass, field

from carpool.engine.block_manager import BlockManager
from carpool.engine.config import EngineConfig
from carpool.engine.sequence import Sequence, SequenceStatus
from carpool.engine.slo import SloController, StepLimits
from carpool.engine.tiers import BACKGROUND_PRIORITY


def aged_priority(priority: int, waited: float, aging_seconds: float, max_boost: int) -> float:
    """A request's tier after waiting `waited` seconds: one tier better per `aging_seconds`, at most `max_boost`
    tiers (EngineConfig's priority_aging_seconds and max_priority_boost), so no tier starves behind a steady stream
    of higher ones."""
    return priority - min(waited / aging_seconds, max_boost)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # KV to copy before the forward, per admitted sequence with a partial prefix hit: (from block, to block, tokens)
    kv_copies: dict[Sequence, tuple[int, int, int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.slo = (
            SloController(config.slo_itl_ms, config.slo_ttft_ms, config.block_size)
            if config.slo_itl_ms or config.slo_ttft_ms
            else None
        )
        self.limits = StepLimits(config.max_num_batched_tokens, config.max_num_seqs, "fixed")  # the last step's
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._held = 0  # this step's tokens held for lower tiers' prompts (limits.reserved, when one can use them)
        self._draft_tokens = 0  # this step's tokens left for speculative lookahead

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues and give its blocks back (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.block_manager.expire_pins()  # lapsed TTL pins become ordinary cache before anything is evicted
        now = time.monotonic()
        # The flags are read every step: the ceilings under the SLO controller, the limits without it.
        ceilings = (self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.limits = (
            self.slo.plan(self.running, self.waiting, now, *ceilings) if self.slo else StepLimits(*ceilings, "fixed")
        )
        # One ordering for everything: aged tier, then arrival. Waiting and running requests are ranked the
        # same way, so a preemption can never be undone by its victim on the next step.
        aging = (self.config.priority_aging_seconds, self.config.max_priority_boost)
        rank = {
            s: (aged_priority(s.priority, now - s.times.arrival, *aging), s.times.arrival, s.seq_id)
            for s in self.running + self.waiting
        }
        self.running.sort(key=rank.__getitem__)
        shed = self._shed_background(batch, rank)
        # A background tier's decodes sit out any step that computes a foreground tier's prompt.
        foreground_prompt = any(
            s.priority < BACKGROUND_PRIORITY and s.num_tokens - s.num_computed_tokens > 1
            for s in self.running + self.waiting
        )
        decodes = [
            s
            for s in self.running
            if s.num_tokens - s.num_computed_tokens == 1
            and not (foreground_prompt and s.priority >= BACKGROUND_PRIORITY)
        ]
        prompts = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1] + self.waiting
        pending = {h for s in self.running for h in self.block_manager.uncomputed_prompt_hashes(s)}
        self._held = (
            self.limits.reserved
            if self.limits.reserved and any(self._may_use_held(s, pending, rank) for s in prompts)
            else 0
        )  # no prefix lookups without a hold
        # Drafts get what is left after every decode's token and the held block: drawn from the whole step,
        # the first decodes' lookahead took the later (priority) decodes' tokens and they sat out the step.
        self._draft_tokens = max(0, self.limits.max_tokens - len(decodes) - self._held)
        for seq in decodes:
            self._schedule_running(seq, batch, rank)
        # Prompt work, running chunks and new admissions alike, in rank order: a priority request's prompt is
        # never queued behind the chunks of a batch-tier prompt that happened to start first.
        admitting = len(batch.preempted) == shed  # a preemption for blocks stops admissions; shedding does not
        for seq in sorted(prompts, key=rank.__getitem__):
            if self._budget(batch) <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:
                self._schedule_running(seq, batch, rank)
                admitting = admitting and len(batch.preempted) == shed
                continue
            if not admitting or seq in batch.preempted:
                continue
            if self._capped(seq, rank):
                continue  # the SLO cap: the batch grows only for the tier it protects until lower ones finish
            if self._budget(batch, seq) <= 0:
                continue  # what is left of the step is held for a lower tier's prompt
            hits = self.block_manager.match_prefix(seq)
            # A waiting request whose next uncached block a running prefill is about to compute waits for it
            # to land in the cache instead of computing it a second time; admission stops there, so no later
            # request overtakes it.
            if self.block_manager.prompt_block_hash(seq, len(hits)) in pending:
                admitting = False
                continue
            admitting = self._admit(seq, batch, rank, now)
            if seq.status is SequenceStatus.RUNNING:
                pending.update(self.block_manager.uncomputed_prompt_hashes(seq))
        return batch

    def _shed_background(self, batch: ScheduledBatch, rank: dict) -> int:
        """Under an ITL or TTFT SLO, running background (Batch API) sequences beyond the SLO's sequence cap step
        aside, worst-ranked first: the seed's "shrink batches for the interactive surge". Without it the cap only
        stopped admissions, so a surge that found a replica running 64 Batch lines waited on 64-sequence steps
        until they finished (128 tokens each: ~19 s of 150 ms steps on one thread). Their computed blocks stay in
        the prefix cache, so coming back recomputes at most a partial block. Live tiers are never shed: they have
        users waiting on each token. How many were shed."""
        if self.limits.reason not in ("itl", "ttft"):
            return 0
        # The protected tier's waiting requests go past the cap: their slots count as taken.
        arriving = sum(1 for s in self.waiting if s.priority <= self.limits.exempt_priority)
        shed = 0
        while len(self.running) + arriving > self.limits.max_seqs:
            background = [s for s in self.running if s.priority >= BACKGROUND_PRIORITY]
            if not background:
                break
            self._preempt(max(background, key=rank.__getitem__), batch)
            shed += 1
        return shed

    def _capped(self, seq: Sequence, rank: dict) -> bool:
        """Whether the SLO cap keeps waiting seq out. Never behind a running sequence of a lower (aged) tier:
        the cap's floor leaves one slot for all lower tiers together, and a flex request holding it kept a
        default one waiting; seq goes past the cap instead (no one is recomputed), the batch shrinks as they finish."""
        if not self.limits.max_seqs <= len(self.running) < self.config.max_num_seqs:
            return False
        if seq.priority <= self.limits.exempt_priority:
            return False
        return not any(rank[r][0] > rank[seq][0] for r in self.running)

    def _may_use_held(self, seq: Sequence, pending: set, rank: dict) -> bool:
        """Whether seq is a lower tier's prompt that this step could compute with the held block: running, or
        waiting without the cap keeping it out nor its next block being computed by a running prefill."""
        if seq.priority <= self.limits.exempt_priority:
            return False
        if seq.status is SequenceStatus.RUNNING:
            return True
        return (
            not self._capped(seq, rank)
            and self.block_manager.prompt_block_hash(seq, len(self.block_manager.match_prefix(seq))) not in pending
        )

    def _budget(self, batch: ScheduledBatch, seq: Sequence | None = None) -> int:
        """Tokens left this step; for seq's prompt, less the block the SLO controller holds for lower tiers."""
        left = self.limits.max_tokens - batch.num_tokens
        if seq is not None and seq.priority <= self.limits.exempt_priority:
            used = sum(
                n
                for s, n in zip(batch.seqs, batch.num_new_tokens)
                if n > 1 and s.priority > self.limits.exempt_priority
            )
            left -= max(0, self._held - used)
        return left

    def _schedule_running(self, seq: Sequence, batch: ScheduledBatch, rank: dict) -> None:
        num_new = min(seq.num_tokens - seq.num_computed_tokens, self._budget(batch, seq))
        if num_new <= 0 or seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
            return
        if seq.num_lookahead_tokens:  # slots for speculative drafts, from what is left over: they preempt no one
            lookahead = min(seq.num_lookahead_tokens, self._draft_tokens) if num_new == 1 else 0
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + num_new + lookahead):
                lookahead = 0
            seq.num_lookahead_tokens = lookahead
            self._draft_tokens -= lookahead
            num_new += lookahead
        while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + num_new):
            victim = max((s for s in self.running if s not in batch.seqs), key=rank.__getitem__)
            self._preempt(victim, batch)
            if victim is seq:
                return
        self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
        self._add_to_batch(batch, seq, num_new)

    def _admit(self, seq: Sequence, batch: ScheduledBatch, rank: dict, now: float) -> bool:
        """Admit seq if slots, blocks and budget allow, preempting lower-ranked running sequences if needed.
        False when it could not be admitted: admission stops there, first come first served."""
        if len(self.running) >= self.config.max_num_seqs and not self._make_room(seq, batch, rank):
            return False
        while True:
            hits = self.block_manager.match_prefix(seq)  # again after a preemption: blocks may have been evicted
            partial = self.block_manager.partial_hit(seq, hits)
            copied = partial.num_tokens if partial else 0
            num_new = min(seq.num_tokens - len(hits) * self.block_manager.block_size - copied, self._budget(batch, seq))
            if self.block_manager.can_admit(seq, hits, copied + num_new):
                break
            if not self._make_room(seq, batch, rank):
                return False
        self.waiting.remove(seq)
        self.block_manager.admit(seq, hits, partial)
        if partial:
            batch.kv_copies[seq] = (partial.block_id, seq.block_table[len(hits)], partial.num_tokens)
        if seq.times.first_scheduled is None:
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.times.first_scheduled = now
        self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._add_to_batch(batch, seq, num_new)
        return True

    def _make_room(self, seq: Sequence, batch: ScheduledBatch, rank: dict) -> bool:
        """Preempt the worst running sequence if its tier ranks strictly below seq's (both aged alike)."""
        if not self.running:
            return False
        victim = max(self.running, key=rank.__getitem__)
        if rank[victim][0] <= rank[seq][0]:
            return False
        self._preempt(victim, batch)
        return True

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]
        self.running.remove(seq)
        self.block_manager.free(seq)
        batch.kv_copies.pop(seq, None)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        batch.preempted.append(seq)
        self.waiting.append(seq)
