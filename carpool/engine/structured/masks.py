"""The per-step token mask of constrained sequences: each keeps a matcher that follows its output tokens, and
only the rows of constrained sequences compute a mask (unconstrained rows are never touched).

A matcher catches up with its sequence's output lazily, at the next mask: whatever appended the tokens (one
sampled token, several accepted draft tokens) needs no hook, and a sequence whose output no longer extends what
the matcher consumed (rolled back) gets a fresh matcher replaying its output. Preemption keeps the output tokens,
so a recomputed sequence continues from the same grammar state.

A step's masks depend only on the output so far, so the engine asks for them before the forward pass
(`prefetch_grammar_masks`) and the sampler applies them after it (`apply_grammar_masks`). The masks are filled
one matcher after another on the calling thread, never by llguidance's parallel executor: its pool thread has to
win a core from the forward pass's OpenMP team, and on the 2-core dev machine a 32-row fill took 4-6 ms through
it against 0.06-0.13 ms inline (the same matchers, one thread). With a core to spare (more cores than torch
threads) the fill runs on a worker thread beside the forward pass (llguidance drops the GIL while it fills).
The bitmask is applied in one vectorised pass: unpacked to a byte per token (numpy) and one masked_fill_ over
the rows (the row-by-row fill it replaces cost 32 small torch calls a step).
"""

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from carpool.engine.sequence import Sequence

_matchers: "weakref.WeakKeyDictionary[Sequence, SequenceMatcher]" = weakref.WeakKeyDictionary()
_worker: ThreadPoolExecutor | None = None
_prefetched = threading.local()  # per engine thread: the Future of the masks asked for before its forward pass


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


class GrammarMasks:
    """The packed masks of some sequences' next tokens: bit t of row i set = token t allowed for seqs[i]; a
    matcher in its error state (a token it did not allow was forced in) is marked, to allow only the end tokens."""

    def __init__(self, seqs: list[Sequence], vocab: int):
        self.rows = {id(seq): i for i, seq in enumerate(seqs)}
        self.packed = np.empty((len(seqs), (vocab + 31) // 32), dtype=np.int32)
        self.errors = []
        row_bytes = self.packed.shape[1] * 4
        for i, seq in enumerate(seqs):
            matcher = matcher_of(seq)
            matcher.unsafe_compute_mask_ptr(self.packed.ctypes.data + i * row_bytes, row_bytes)
            if matcher.is_error():
                self.errors.append(i)

    def covers(self, seqs: list[Sequence]) -> bool:
        return all(id(seq) in self.rows for seq in seqs)

    def blocked(self, seqs: list[Sequence], vocab: int, end_token_ids: frozenset[int]) -> np.ndarray:
        """[len(seqs), vocab] uint8, 1 where seqs[i] may not take the token."""
        packed = self.packed[[self.rows[id(seq)] for seq in seqs]]
        blocked = np.unpackbits(np.invert(packed).view(np.uint8), axis=1, count=vocab, bitorder="little")
        errors = [i for i, seq in enumerate(seqs) if self.rows[id(seq)] in self.errors]
        if errors:
            blocked[errors] = 1
            blocked[np.ix_(errors, sorted(end_token_ids))] = 0
        return blocked


def _constrained_to_sample(seqs: list[Sequence], num_new_tokens: list[int]) -> list[Sequence]:
    # A constrained sequence never speculates: it samples when this step reaches its last token.
    return [seq for seq, n in zip(seqs, num_new_tokens)
            if seq.params.structured and seq.num_computed_tokens + n == seq.num_tokens]


def overlaps_forward() -> bool:
    """Whether prefetched masks are filled beside the forward pass: only with a core it does not use."""
    return (os.cpu_count() or 1) > torch.get_num_threads()


def prefetch_grammar_masks(seqs: list[Sequence], num_new_tokens: list[int], vocab: int) -> None:
    """Ask, before the forward pass, for the masks of the constrained sequences that sample this step."""
    global _worker
    _wait_prefetched()
    constrained = _constrained_to_sample(seqs, num_new_tokens)
    if not constrained:
        return
    if overlaps_forward():
        _worker = _worker or ThreadPoolExecutor(1, thread_name_prefix="carpool-grammar-masks")
        _prefetched.masks = _worker.submit(GrammarMasks, constrained, vocab)
    else:
        done = Future()
        done.set_result(GrammarMasks(constrained, vocab))
        _prefetched.masks = done


def _wait_prefetched() -> GrammarMasks | None:
    """The masks prefetched on this thread, once filled (a worker never touches a matcher after this returns)."""
    future = getattr(_prefetched, "masks", None)
    _prefetched.masks = None
    return None if future is None else future.result()


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                        end_token_ids: frozenset[int]) -> None:
    """Set to -inf, in place, every token the grammar of seqs[row] does not allow next, for each row in `rows`."""
    vocab = logits.shape[-1]
    constrained = [seqs[row] for row in rows]
    masks = _wait_prefetched()
    if masks is None or not masks.covers(constrained):
        masks = GrammarMasks(constrained, vocab)
    blocked = torch.from_numpy(masks.blocked(constrained, vocab, end_token_ids)).view(torch.bool).to(logits.device)
    if rows == list(range(len(seqs))):
        logits.masked_fill_(blocked, float("-inf"))
    else:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill_(blocked, float("-inf"))
