"""carpool: an LLM inference server built around the economics of serving."""

from carpool.engine.sampling_params import SamplingParams
from carpool.llm import LLM

__all__ = ["LLM", "SamplingParams"]
