"""What a request's parameters do to its next-token logits before sampling: penalties, logit_bias and banned
tokens (min_tokens, bad_words).

Each adjustment is batched over the rows that ask for it and touches nothing else: a batch whose requests use
none of them costs one pass over their parameters and no tensor work. Python loops run over a request's own
entries (its tokens, biases, bad words), never over the vocabulary.
"""

import itertools

import torch

from carpool.engine.sequence import Sequence


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None) -> torch.Tensor:
    """The logits to sample from: `logits` itself when no row asks for anything, else an adjusted copy."""
    penalized = [row for row, seq in enumerate(seqs) if seq.params.penalized]
    biased = [row for row, seq in enumerate(seqs) if seq.params.logit_bias]
    banned = [(row, token) for row, seq in enumerate(seqs) for token in _banned_tokens(seq, eos_token_id)]
    if not (penalized or biased or banned):
        return logits
    logits = logits.clone()
    if penalized:
        _apply_penalties(logits, [seqs[row] for row in penalized], penalized)
    if biased:
        entries = [(row, token, bias) for row in biased for token, bias in seqs[row].params.logit_bias.items()]
        rows, tokens, biases = zip(*entries)
        index = (_long(rows, logits.device), _long(tokens, logits.device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)
    if banned:
        rows, tokens = zip(*banned)
        logits[_long(rows, logits.device), _long(tokens, logits.device)] = float("-inf")
    return logits


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    device, vocab = logits.device, logits.shape[-1]
    index = _long(rows, device)
    selected = logits[index]
    repetition = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=logits.dtype, device=device)
    if bool((repetition != 1).any()):
        seen = _token_counts([s.token_ids for s in seqs], vocab, device) > 0
        scaled = torch.where(selected > 0, selected / repetition[:, None], selected * repetition[:, None])
        # A repetition_penalty near zero divides a positive logit past float32's range: keep it finite (the
        # largest float), so the softmax that follows sees no inf - inf.
        finite = torch.finfo(logits.dtype).max
        selected = torch.where(seen, scaled.clamp(-finite, finite), selected)
    presence = torch.tensor([s.params.presence_penalty for s in seqs], dtype=logits.dtype, device=device)
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=logits.dtype, device=device)
    if bool(presence.any() or frequency.any()):
        counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)
        selected = selected - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    logits[index] = selected


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    if int(lengths.sum()):
        rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
        tokens = _long(list(itertools.chain.from_iterable(token_lists)), device)
        counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
    return counts


def _banned_tokens(seq: Sequence, eos_token_id: int | None) -> list[int]:
    params = seq.params
    banned = []
    if seq.num_output_tokens < params.min_tokens:
        if eos_token_id is not None and not params.ignore_eos:
            banned.append(eos_token_id)
        banned.extend(params.stop_token_ids or ())
    for word in seq.bad_words_token_ids:
        # vLLM's rule: the word's last token is banned where the output so far ends with the rest of the word.
        prefix = word[:-1]
        if not prefix or (len(prefix) <= seq.num_output_tokens and seq.token_ids[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def _long(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
