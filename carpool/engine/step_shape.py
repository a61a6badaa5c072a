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
