"""Speculative decoding: a drafter proposes tokens, the target verifies them inside the continuous batch.

Drafters: `ngram` (prompt lookup, carpool.engine.spec_decode.ngram) or a draft model sharing the target's
tokenizer (draft_model). Verification (rejection_sampler) keeps the output the target's: greedy and seeded
outputs token for token, sampled ones in distribution. The policy sets how many drafts a step verifies from
the batch size and the measured acceptance (0 when the step is compute-bound); the speculator runs the three
phases around the scheduler and the forward pass.
"""

from carpool.engine.spec_decode.speculator import SpecStepStats, Speculator

__all__ = ["SpecStepStats", "Speculator"]
