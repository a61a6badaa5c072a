"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

No second model and no KV of its own. It pays where the output copies its context (document QA, summaries,
code edits) and proposes nothing elsewhere, so a sequence without a match simply decodes one token.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the last n tokens, longest n first."""
    if k <= 0 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # Windows starting at 0 .. len - n - 1: every n-gram before the suffix itself (they may overlap it).
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return token_ids[follow : follow + k]
    return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list) -> None:
        """Set each sequence's spec_token_ids: at most its num_lookahead_tokens drafts, each a point mass."""
        for seq in seqs:
            seq.spec_token_ids = propose_ngram(seq.token_ids, seq.num_lookahead_tokens, self.min_n, self.max_n)
            seq.spec_probs = None

    def retain(self, seq_ids: set[int]) -> None:
        """Nothing is kept per sequence."""
