"""Next-token selection per request: greedy, or temperature / top-k / top-p / min-p sampling from the
request's own seeded stream, after the request's penalties, biases and bans; plus logprobs of the sampled token
and the top alternatives (from the model's own logits, as vLLM reports them)."""

import torch

import carpool.kernels  # noqa: F401  (registers torch.ops.carpool)
from carpool.engine.logits_processors import adjust_logits
from carpool.engine.sequence import Sequence, TokenLogprob

_GOLDEN = 0x9E3779B97F4A7C15


def _token_seed(seq: Sequence) -> int:
    # A distinct, reproducible stream per (request seed, output position): the same tokens come out whatever
    # the batch, and again after a preemption recomputes the sequence.
    return (seq.sampling_seed + seq.num_output_tokens * _GOLDEN) % (1 << 63)


def _filtered_logits(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    params = seq.params
    # Shifting by the maximum first keeps the division finite for any temperature the params accept (>= 1e-5):
    # the best token lands on 0 and the rest on finite negatives or -inf, never inf - inf.
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p. The best token always stays: a top_p
        # below float32's smallest number (1e-320) rounds to 0, and "above it reach 0" would drop it too.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, seqs: list[Sequence], end_token_ids: frozenset[int] = frozenset()
) -> tuple[list[int], list[TokenLogprob | None]]:
    # After sampling, the raw logits are read only for logprobs (and by the verifier, for rows that speculate,
    # which constrained rows never do): a grammar may mask its rows in place unless one of them reports logprobs.
    in_place = not any(seq.params.structured and _wants_logprobs(seq) for seq in seqs)
    adjusted = adjust_logits(logits, seqs, end_token_ids, mask_in_place=in_place)
    tokens = first_maxima(adjusted)
    for row, seq in enumerate(seqs):
        if seq.params.greedy:
            continue
        probs = torch.softmax(_filtered_logits(adjusted[row].float(), seq), dim=-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws a token with probability p.
        noise = torch.empty_like(probs).exponential_(generator=token_generator(seq, logits.device))
        tokens[row] = int((probs / noise).argmax())
    return tokens, token_logprobs(logits, tokens, seqs)


def first_maxima(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token: the first of its largest logits (a NaN's if it has one), as max(dim=-1) finds it.
    On the CPU from the logits as they are (`torch.ops.carpool.row_argmax`): widening 32 x 151,936 bf16 logits to
    fp32 and reducing them took 2.2-2.8 ms, the kernel 0.12 ms (Zen 4, 2 threads, `python -m carpool.bench.greedy`).
    Elsewhere max's indices, at 2.5x argmax's speed."""
    if logits.device.type == "cpu":
        return torch.ops.carpool.row_argmax(logits).tolist()
    return logits.max(dim=-1).indices.tolist()


def token_generator(seq: Sequence, device: torch.device, salt: int = 0) -> torch.Generator:
    """The seeded stream of seq's next output position (`salt` != 0: another stream of the same position)."""
    return torch.Generator(device=device).manual_seed(_token_seed(seq) ^ salt)


def filtered_probs(logits: torch.Tensor, seq: Sequence, end_token_ids: frozenset[int]) -> torch.Tensor:
    """One row of logits -> the distribution `sample` draws seq's next token from (at temperature > 0)."""
    adjusted = adjust_logits(logits[None], [seq], end_token_ids)[0]
    return torch.softmax(_filtered_logits(adjusted.float(), seq), dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], seqs: list[Sequence]) -> list[TokenLogprob | None]:
    """The model's own logprob of each row's token, and the top alternatives, for the rows that ask."""
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    wanted = [row for row, seq in enumerate(seqs) if _wants_logprobs(seq)]
    if wanted:
        log_probs = torch.log_softmax(logits[wanted].float(), dim=-1)
        for i, row in enumerate(wanted):
            k = seqs[row].params.logprobs
            top = torch.topk(log_probs[i], k) if k else None
            logprobs[row] = TokenLogprob(
                token_id=tokens[row],
                logprob=float(log_probs[i, tokens[row]]),
                top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
            )
    return logprobs


def _wants_logprobs(seq: Sequence) -> bool:
    return seq.params.logprobs is not None or seq.params.ranked
