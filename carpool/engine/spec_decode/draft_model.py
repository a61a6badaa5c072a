"""A small model that shares the target's tokenizer drafts k tokens per sequence, one batched forward pass
per draft position, over a paged KV pool of its own (its own ModelRunner and BlockManager, as many blocks as
the target's: the engine splits the KV budget between the two).

Each target sequence has a shadow sequence here. Before drafting it is synced with the target: tokens past
the last one both agree on (rejected drafts) are dropped, their KV with them, and the target's newer tokens
are computed in the first pass along with the first draft. A sequence that leaves the running batch
(finished, aborted, preempted) gives its shadow's blocks back.

The draft drafts from a subset of the vocabulary (FR-Spec; SGLang's --speculative-token-map): its LM head keeps
only the rows of the first N token ids plus the special ones, so a pass computes N logits instead of every one.
Byte-level BPE numbers tokens in merge order, which follows corpus frequency, so the first ids are a data-free
stand-in for the most frequent. Qwen2.5-Coder-0.5B's head is 146 MB of Q8_0 for 151,936 tokens, over a third of
the 409 MB a draft pass reads; at N = 65536 (the default) it is 63 MB, and a pass costs 15% less CPU time
(docs/benchmarks/journal.md). Speculation stays lossless: the target verifies, and a sampled draft's q is the
distribution it was drawn from (zero outside the subset).
"""

from dataclasses import replace

import torch
from torch import nn

from carpool.engine.block_manager import BlockManager
from carpool.engine.config import DRAFT_VOCAB_SIZE
from carpool.engine.model_runner import ModelRunner
from carpool.engine.sampler import filtered_probs, token_generator
from carpool.engine.scheduler import ScheduledBatch
from carpool.engine.sequence import Sequence
from carpool.engine.spec_decode.rejection_sampler import Extended
from carpool.models.quantization import GGMLLinear

_DRAFT_STREAM = 0x5DEECE66D  # the draft's seeded stream at a position, apart from the target's at the same one


class DraftModelDrafter:
    def __init__(
        self,
        name: str,
        model,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        target_vocab_size: int,
        end_token_ids: frozenset[int],
        enable_prefix_caching: bool,
        draft_vocab_size: int | None = None,
        special_token_ids: frozenset[int] = frozenset(),
        reproducible: bool = False,
    ):
        """draft_vocab_size: draft from the first that many token ids plus special_token_ids and the end tokens
        (None: DRAFT_VOCAB_SIZE where the vocabulary is larger, else all of it). reproducible: a seeded request's
        output is the one decoding without speculation gives, whatever the batch or the speculation schedule: the
        draft samples with the target's own stream for the position (the same exponential race over q that the
        target then runs over p) and verification keeps a draft while it equals the target's sample (rejection
        sampling's draws depend on which positions were drafted). Its prompts attend as its decode rows do."""
        self.name = name
        self.model = model
        # Token ids the draft proposes, in the order of its logits; None: all, its logits are the vocabulary's.
        self.draft_ids = draft_vocabulary(
            min(model.config.vocab_size, target_vocab_size), draft_vocab_size, special_token_ids | end_token_ids
        )
        if self.draft_ids is not None:
            model.lm_head = head_rows(model.lm_head, self.draft_ids.to(device))
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype, reproducible=reproducible)
        self.reproducible = reproducible
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.vocab_size = target_vocab_size
        self.end_token_ids = end_token_ids
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> shadow
        self.mirrored: dict[int, int] = {}  # target seq_id -> target tokens the shadow held at the last sync
        # Whether the last propose computed a shadow's prompt (a request's first drafts, or after preemption):
        # a cost paid once per request, which the policy must not take for the price of every drafting step.
        self.prefilled = False

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        return ModelRunner.kv_bytes_per_block(model.config, block_size, dtype)

    def retain(self, seq_ids: set[int]) -> None:
        """Free the shadows of sequences no longer running."""
        for seq_id in [s for s in self.shadows if s not in seq_ids]:
            self.block_manager.free(self.shadows.pop(seq_id))
            del self.mirrored[seq_id]

    def propose(self, seqs: list[Sequence]) -> None:
        """Set each sequence's spec_token_ids (at most its num_lookahead_tokens) and spec_probs (None when the
        request is greedy: drafts are the draft's argmax)."""
        for seq in seqs:
            seq.spec_token_ids, seq.spec_probs = [], None
        active = [seq for seq in seqs if self._sync(seq)]
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq in active}
        position = 0
        self.prefilled = False
        while active:
            batch = ScheduledBatch()
            for seq in active:
                shadow = self.shadows[seq.seq_id]
                if not self.block_manager.can_allocate(shadow, shadow.num_tokens):
                    continue  # the draft pool is full: this sequence stops drafting here
                self.block_manager.allocate(shadow, shadow.num_tokens)
                batch.seqs.append(shadow)
                batch.num_new_tokens.append(shadow.num_tokens - shadow.num_computed_tokens)
            if not batch:
                break
            # Past a verification a shadow catches up with at most its accepted drafts and the new token.
            self.prefilled |= max(batch.num_new_tokens) > max(seq.num_lookahead_tokens for seq in active) + 1
            logits, ran = self.runner.run(batch)
            # The runner's rows follow its own order (decodes first, shortest context first), not the batch's: read
            # by this order, a batch of several lengths drafted each sequence from another's logits (SmolLM2
            # drafting for itself kept 4 of 312 greedy drafts over four prompts, instead of all).
            row_of = {id(shadow): row for row, shadow in enumerate(ran)}
            drafted = [seq for seq in active if id(self.shadows[seq.seq_id]) in row_of]
            for seq in drafted:
                shadow = self.shadows[seq.seq_id]
                row = row_of[id(shadow)]
                shadow.num_computed_tokens = shadow.num_tokens
                token = self._draft(logits[row, : self.vocab_size], seq, probs[seq.seq_id])
                shadow.token_ids.append(token)
                seq.spec_token_ids.append(token)
            position += 1
            active = [seq for seq in drafted if position < seq.num_lookahead_tokens]
        for seq_id, rows in probs.items():
            if rows:
                seq = next(s for s in seqs if s.seq_id == seq_id)
                seq.spec_probs = torch.stack(rows)

    def _draft(self, logits: torch.Tensor, seq: Sequence, probs: list[torch.Tensor]) -> int:
        """The next draft: the argmax for a greedy request, else a sample of the draft's filtered distribution
        q (kept in probs for verification), from the request's seeded stream for that position; when reproducible
        the target's own stream, with q not kept (a point-mass draft: the target's sample decides)."""
        if seq.params.greedy:
            index = int(logits.argmax())
            return index if self.draft_ids is None else int(self.draft_ids[index])
        if self.draft_ids is not None:  # q is zero outside the subset: the tokens the draft never proposes
            logits = logits.new_full((self.vocab_size,), float("-inf")).index_copy_(
                0, self.draft_ids.to(logits.device), logits
            )
        elif logits.shape[-1] < self.vocab_size:  # a draft with a smaller embedding never proposes the rest
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        view = Extended(seq, seq.spec_token_ids)
        q = filtered_probs(logits, view, self.end_token_ids)
        stream = token_generator(view, q.device, 0 if self.reproducible else _DRAFT_STREAM)
        if not self.reproducible:
            probs.append(q)
        return int((q / torch.empty_like(q).exponential_(generator=stream)).argmax())

    def _sync(self, seq: Sequence) -> bool:
        """Bring seq's shadow up to seq's tokens; False when the draft pool has no room for it."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            # The draft needs no prompt logprobs: computing them would cost every prompt logit and bar the
            # draft pool's prefix cache (match_prefix serves nothing to a request that wants them).
            shadow = Sequence(
                seq.request_id, seq.token_ids, replace(seq.params, prompt_logprobs=None), cache_salt=seq.cache_salt
            )  # the draft pool scopes its prefix cache as the target does
            hits = self.block_manager.match_prefix(shadow)
            if not self.block_manager.can_admit(
                shadow, hits, shadow.num_tokens - len(hits) * self.block_manager.block_size
            ):
                return False
            self.block_manager.admit(shadow, hits)
            self.shadows[seq.seq_id] = shadow
            self.mirrored[seq.seq_id] = seq.num_tokens
            return True
        agreed = self.mirrored[seq.seq_id]
        old = shadow.token_ids
        while agreed < min(len(old), seq.num_tokens) and old[agreed] == seq.token_ids[agreed]:
            agreed += 1
        del old[agreed:]
        old.extend(seq.token_ids[agreed:])
        self.mirrored[seq.seq_id] = seq.num_tokens
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, agreed)
        self.block_manager.truncate(shadow, shadow.num_computed_tokens)
        # Only tokens the target agreed to reach the prefix cache: a block of drafts could be rejected later
        # while its hash stayed registered.
        self.block_manager.cache_full_blocks(shadow)
        return True


def draft_vocabulary(vocab_size: int, size: int | None, always: frozenset[int]) -> torch.Tensor | None:
    """The sorted token ids a draft with vocab_size logits drafts from: the first `size` and `always` (special
    and end tokens: a chat reply's end is a draft the target accepts on every request); None: all of them."""
    if size is None:
        size = min(DRAFT_VOCAB_SIZE, vocab_size)
    if size > vocab_size:
        raise ValueError(
            f"speculative_vocab_size must not exceed the draft model's vocabulary ({vocab_size} tokens), got {size}"
        )
    if size == vocab_size:
        return None
    return torch.tensor(sorted(set(range(size)) | {i for i in always if size <= i < vocab_size}), dtype=torch.long)


def head_rows(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """An LM head computing only the logits of `ids`, in their order: a copy of those rows, in the head's format."""
    if isinstance(head, GGMLLinear):
        return head.rows(ids)
    rows = nn.Linear(head.in_features, len(ids), bias=False, device=head.weight.device, dtype=head.weight.dtype)
    rows.weight = nn.Parameter(head.weight.detach().index_select(0, ids), requires_grad=False)
    return rows
