"""The per-step token mask of constrained sequences: each keeps a matcher that follows its output tokens, and
only the rows of constrained sequences compute a mask (unconstrained rows are never touched).

A matcher catches up with its sequence's output lazily, at the next mask: whatever appended the tokens (one
sampled token, several accepted draft tokens) needs no hook, and a sequence whose output no longer extends what
the matcher consumed (rolled back) gets a fresh matcher replaying its output. Preemption keeps the output tokens,
so a recomputed sequence continues from the same grammar state.

Cost per step, one thread on the loaded dev machine: 0.25 / 0.5 / 1.8 ms for 1 / 8 / 32 constrained rows of
SmolLM2's 49K vocabulary, 0.4 / 2.4 / 9.6 ms on Qwen2.5's 152K, mostly writing -inf across each row.
"""

import weakref

import llguidance
import llguidance.torch
import numpy as np
import torch

from carpool.engine.sequence import Sequence

_matchers: "weakref.WeakKeyDictionary[Sequence, SequenceMatcher]" = weakref.WeakKeyDictionary()
_executor: llguidance.LLExecutor | None = None


class SequenceMatcher:
    def __init__(self, seq: Sequence):
        self.matcher = seq.params.structured.grammar.matcher()
        self.consumed: list[int] = []

    def follow(self, seq: Sequence) -> llguidance.LLMatcher:
        output = seq.output_token_ids
        if output[: len(self.consumed)] != self.consumed:
            self.matcher.reset()
            self.consumed = []
        new = output[len(self.consumed):]
        if new:
            # A token the mask allowed is always accepted; one that is not (ignore_eos past the end) puts the
            # matcher in its error state, where the mask allows only the end tokens.
            self.matcher.consume_tokens(new)
            self.consumed = output
        return self.matcher


def matcher_of(seq: Sequence) -> llguidance.LLMatcher:
    state = _matchers.get(seq)
    if state is None:
        state = _matchers[seq] = SequenceMatcher(seq)
    return state.follow(seq)


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                        end_token_ids: frozenset[int]) -> None:
    """Set to -inf, in place, every token the grammar of seqs[row] does not allow next, for each row in `rows`."""
    global _executor
    vocab = logits.shape[-1]
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), vocab)
    matchers = [(matcher_of(seqs[row]), i) for i, row in enumerate(rows)]
    if len(matchers) == 1:
        llguidance.torch.fill_next_token_bitmask(matchers[0][0], bitmask, 0)
    else:
        _executor = _executor or llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(_executor, matchers, bitmask)
    blocked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    for i, (matcher, _) in enumerate(matchers):
        if matcher.is_error():
            blocked[i] = True
            blocked[i, list(end_token_ids)] = False
    blocked = torch.from_numpy(blocked).to(logits.device)
    # Row by row, in place: a gather of the rows, a masked copy and a scatter back cost 3x as much (8 rows of a
    # 49K vocabulary: 1.1 ms against 0.35 ms on one thread).
    for i, row in enumerate(rows):
        logits[row].masked_fill_(blocked[i], float("-inf"))
