"""The engine's speculative decoding, step by step:

1. `plan` (before scheduling): how many drafts each decoding sequence may have this step (the policy's k, or
   fewer near max_tokens and the context window; none for requests that opt out or are constrained by a
   grammar, whose masks follow the output token by token). The scheduler reserves KV slots for them, from the
   step's token budget and free blocks only: drafts never preempt anyone.
2. `propose` (after scheduling): the drafter fills the reserved slots; each sequence's segment becomes its
   pending token plus its drafts, verified in the same forward pass as the rest of the batch.
3. `observe` (after verification): a decode step's tokens and seconds (drafting included) feed the policy,
   and the step's counts go to the metrics.
"""

import time
from dataclasses import dataclass, field

from carpool.engine.scheduler import ScheduledBatch
from carpool.engine.sequence import Sequence
from carpool.engine.spec_decode.policy import SpeculationPolicy


@dataclass
class SpecStepStats:
    """One step's speculation, for metrics (vLLM's spec_decode_* counters)."""

    drafter: str
    num_drafts: int = 0  # sequences that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per sequence that verified drafts


class Speculator:
    def __init__(self, drafter, max_k: int):
        self.drafter = drafter
        self.policy = SpeculationPolicy(max_k)
        self.k = 0  # this step's drafts per sequence, as planned
        self.draft_seconds = 0.0  # this step's drafting time
        self.prefilled = False  # whether this step's drafting computed a prompt in a draft model (once a request)

    def plan(self, running: list[Sequence], max_model_len: int) -> None:
        self.drafter.retain({seq.seq_id for seq in running})
        decoding = [seq for seq in running if seq.num_tokens - seq.num_computed_tokens == 1]
        self.k = k = self.policy.num_drafts(len(decoding))
        self.draft_seconds, self.prefilled = 0.0, False
        for seq in running:
            seq.num_lookahead_tokens = 0
        for seq in decoding:
            params = seq.params
            if params.speculative and params.structured is None:
                # The step yields up to k + 1 tokens: past max_tokens or the context window they would be cut.
                room = min(params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens)
                seq.num_lookahead_tokens = max(0, min(k, room))

    def propose(self, batch: ScheduledBatch) -> None:
        """Draft into the slots the scheduler reserved, and shrink each segment to the drafts proposed."""
        seqs = [seq for seq in batch.seqs if seq.num_lookahead_tokens]
        if not seqs:
            return
        start = time.monotonic()
        self.drafter.propose(seqs)
        # Less a drafter's one-off set-up per sequence (n-gram lookup indexing a context), not a cost of drafting.
        self.draft_seconds = time.monotonic() - start - getattr(self.drafter, "setup_seconds", 0.0)
        self.prefilled = getattr(self.drafter, "prefilled", False)
        for i, seq in enumerate(batch.seqs):
            if seq.num_lookahead_tokens:
                batch.num_new_tokens[i] -= seq.num_lookahead_tokens - len(seq.spec_token_ids)

    def observe(
        self,
        batch: ScheduledBatch,
        sampling: list[Sequence],
        sampled: list[tuple[list[int], list]],
        forward_seconds: float,
    ) -> SpecStepStats:
        # Only decode steps (plain and verifying) teach the policy: a prefill chunk in the step, the target's or
        # a draft model's first pass over a prompt, would charge its time to the decodes beside it.
        decode_only = all(n == 1 + len(seq.spec_token_ids) for seq, n in zip(batch.seqs, batch.num_new_tokens))
        if decode_only and not self.prefilled:
            tokens = sum(len(emitted) for emitted, _ in sampled)
            self.policy.observe(len(batch.seqs), self.k, tokens, forward_seconds + self.draft_seconds)
        stats = SpecStepStats(self.drafter.name)
        for seq, (tokens, _) in zip(sampling, sampled):
            k = len(seq.spec_token_ids)
            if not k:
                continue
            accepted = len(tokens) - 1
            stats.num_drafts += 1
            stats.num_draft_tokens += k
            stats.num_accepted_tokens += accepted
            stats.accepted_lengths.append(accepted)
        return stats
