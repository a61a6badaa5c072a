"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`). Running decodes are served first (one token each),
so a long prompt never freezes other streams; then running prompts continue in chunks; then waiting requests
are admitted, best tier first and first-come-first-served within a tier. When blocks or sequence slots run
out, the running sequence with the worst (tier, arrival) is preempted by recompute and goes back to the
waiting queue with its original arrival, so it keeps its place.
"""

import time
from dataclasses import dataclass, field

from carpool.engine.block_manager import BlockManager
from carpool.engine.config import EngineConfig
from carpool.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

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

    def effective_priority(self, seq: Sequence, now: float) -> float:
        boost = min((now - seq.times.arrival) / self.config.priority_aging_seconds, self.config.max_priority_boost)
        return seq.priority - boost

    @staticmethod
    def _rank(seq: Sequence) -> tuple:
        return (seq.priority, seq.times.arrival, seq.seq_id)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.running.sort(key=self._rank)
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            budget = self._budget(batch)
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = max((s for s in self.running if s not in batch.seqs), key=self._rank)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
                self._add_to_batch(batch, seq, num_new)
        if not batch.preempted:
            self._admit_waiting(batch, time.monotonic())
        return batch

    def _budget(self, batch: ScheduledBatch) -> int:
        return self.config.max_num_batched_tokens - batch.num_tokens

    def _admit_waiting(self, batch: ScheduledBatch, now: float) -> None:
        self.waiting.sort(key=lambda s: (self.effective_priority(s, now), s.times.arrival, s.seq_id))
        # Prompt blocks that running prefills are about to compute: a waiting request whose next uncached
        # block is among them waits for it to land in the cache instead of computing it a second time.
        pending = {h for s in self.running for h in self.block_manager.uncomputed_prompt_hashes(s)}
        deferred_rank = None
        for seq in list(self.waiting):
            if seq in batch.preempted:
                continue
            rank = self.effective_priority(seq, now)
            if deferred_rank is not None and rank > deferred_rank:
                return  # never let a lower tier overtake a request that is only waiting for its prefix
            hits = self.block_manager.match_prefix(seq)
            if self.block_manager.prompt_block_hash(seq, len(hits)) in pending:
                deferred_rank = rank if deferred_rank is None else deferred_rank
                continue
            if len(self.running) >= self.config.max_num_seqs and not self._make_room(rank, batch):
                return
            if self._budget(batch) == 0:
                return
            hits = self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * self.block_manager.block_size, self._budget(batch))
            while not self.block_manager.can_admit(seq, hits, num_new):
                if not self._make_room(rank, batch):
                    return
                hits = self.block_manager.match_prefix(seq)  # the victim's blocks may have been evicted
                num_new = min(seq.num_tokens - len(hits) * self.block_manager.block_size, self._budget(batch))
            self.waiting.remove(seq)
            self.block_manager.admit(seq, hits)
            if seq.times.first_scheduled is None:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
                seq.times.first_scheduled = now
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, num_new)
            pending.update(self.block_manager.uncomputed_prompt_hashes(seq))

    def _make_room(self, rank: float, batch: ScheduledBatch) -> bool:
        """Preempt the worst running sequence if its tier ranks strictly below `rank`."""
        if not self.running:
            return False
        victim = max(self.running, key=self._rank)
        if victim.priority <= rank:
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
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        batch.preempted.append(seq)
        self.waiting.append(seq)
