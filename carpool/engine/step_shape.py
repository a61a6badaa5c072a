"""What a step's attention computes, from its batch as scheduled: the step-time models' inputs beyond token counts
(carpool.bench.simulate's StepModel fits them; `carpool serve --step-log` records them for `carpool cost whatif`)."""


def attention_pairs(chunk: int, computed: int) -> int:
    """Query-key pairs a prompt chunk of `chunk` tokens computes after `computed` tokens of its sequence: each of
    its queries sees the earlier tokens and the chunk's own up to itself."""
    return chunk * computed + chunk * (chunk + 1) // 2


def step_shape(scheduled: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(KV tokens the decodes read, query-key pairs the prompt chunks compute) of a step whose sequences had, as
    scheduled, (tokens computed before the step, new tokens in it, prompt tokens) each."""
    context = pairs = 0
    for computed, new, prompt in scheduled:
        if computed < prompt:
            pairs += attention_pairs(new, computed)
        else:
            context += computed
    return context, pairs


FIT_FIELDS = ("prefill_tokens", "decode_seqs", "context_tokens", "prefill_pairs", "seconds")


def fit_row(stats) -> tuple[int, int, int, int, float]:
    """A step's StepStats (carpool.engine.llm_engine) as StepModel.fit reads it, in FIT_FIELDS' order: prompt
    tokens, decoding sequences, KV tokens the decodes read, prompt chunks' query-key pairs, seconds."""
    return (
        stats.num_prefill_tokens,
        stats.num_decode_tokens,
        stats.decode_context_tokens,
        stats.prefill_pairs,
        stats.duration,
    )
