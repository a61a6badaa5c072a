"""Model cascades (FrugalGPT, Chen, Zaharia, Zou 2023): ask the cheap model first, score its answer from its own
token logprobs, escalate to the next model only when the score is below the step's threshold."""
