"""Verification: which of a sequence's drafts the target keeps, and the token that follows them.

Each draft position has one row of target logits (all scored in the same forward pass). A position is sampled
exactly as plain decoding would sample it: the same logits processors over the output so far (drafts before it
included), the same seeded stream per output position. Then:

- Point-mass drafts (n-gram lookup, greedy drafting): the target's own sample y at each position decides:
  the draft x is kept while y == x, and the first y != x is emitted in its place. That is modified rejection
  sampling with a one-hot q (x kept with probability p(x), else a sample of p without x, renormalised),
  coupled to the plain sampler's randomness: every emitted token is the one decoding without speculation
  would have emitted, greedy or seeded.
- Sampled drafts (a draft model at temperature > 0, x ~ q): x is kept with probability min(1, p(x) / q(x));
  at the first rejection a token is drawn from normalize(max(0, p - q)) and the step ends (Leviathan et al.
  2022). The output follows p exactly; a seeded request reproduces for the same speculation schedule.
If every draft is kept, the last row gives one more token: k drafts yield up to k + 1 tokens.
"""

import torch

from carpool.engine.sampler import filtered_probs, sample, token_generator, token_logprobs
from carpool.engine.sequence import Sequence, TokenLogprob


class Extended:
    """A sequence as the sampler sees it at a later draft position: its tokens plus the drafts before it."""

    def __init__(self, seq: Sequence, drafts: list[int]):
        self.params = seq.params
        self.sampling_seed = seq.sampling_seed
        self.bad_words_token_ids = seq.bad_words_token_ids
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.token_ids = seq.token_ids + drafts

    output_token_ids = Sequence.output_token_ids  # the same properties over these token_ids
    num_output_tokens = Sequence.num_output_tokens


def positions(seq: Sequence) -> list:
    """What each of seq's logits rows is sampled as: the sequence, then itself extended by 1..k drafts."""
    drafts = seq.spec_token_ids
    return [seq] + [Extended(seq, drafts[:j]) for j in range(1, len(drafts) + 1)]


def sample_verified(
    logits: torch.Tensor, seqs: list[Sequence], end_token_ids: frozenset[int]
) -> list[tuple[list[int], list[TokenLogprob | None]]]:
    """logits: 1 + len(seq.spec_token_ids) rows per sequence, in order. The tokens each sequence gains this
    step (accepted drafts, then one sampled token) and their logprobs (the target's)."""
    views = [view for seq in seqs for view in positions(seq)]
    tokens, logprobs = sample(logits, views, end_token_ids)
    results, row = [], 0
    for seq in seqs:
        k = len(seq.spec_token_ids)
        picked = tokens[row : row + k + 1]
        if seq.spec_probs is None or seq.params.greedy:
            n = num_accepted(seq.spec_token_ids, picked)
            results.append((picked[: n + 1], logprobs[row : row + n + 1]))
        else:
            rows = views[row : row + k + 1]
            probs = torch.stack([filtered_probs(logits[row + j], view, end_token_ids) for j, view in enumerate(rows)])
            emitted = rejection_sample(
                probs, seq.spec_probs, seq.spec_token_ids, [token_generator(view, logits.device) for view in rows]
            )
            results.append((emitted, token_logprobs(logits[row : row + len(emitted)], emitted, rows[: len(emitted)])))
        row += k + 1
    return results


def num_accepted(drafts: list[int], picked: list[int]) -> int:
    """How many drafts, from the first, equal the target's picks."""
    n = 0
    while n < len(drafts) and drafts[n] == picked[n]:
        n += 1
    return n


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to sample from after rejecting a draft: the target's mass the draft under-proposes."""
    return (p - q).clamp_(min=0)


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: list[int], generators: list[torch.Generator]
) -> list[int]:
    """p: [k + 1, vocab] target probabilities, q: [k, vocab] the draft's, drafts: the k tokens sampled from q,
    generators: one per position. Returns the accepted drafts and one more token."""
    emitted = []
    for j, x in enumerate(drafts):
        u = torch.rand((), generator=generators[j], device=p.device)
        if u * q[j, x] < p[j, x]:  # accept with probability min(1, p(x) / q(x))
            emitted.append(x)
            continue
        emitted.append(_draw(residual(p[j], q[j]), generators[j]))
        return emitted
    emitted.append(_draw(p[len(drafts)], generators[len(drafts)]))
    return emitted


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """A token with probability proportional to weights (the sampler's exponential race)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
