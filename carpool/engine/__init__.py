"""The engine: continuous batching over a paged KV cache, with prefix caching and service tiers.

What it offers the layers above (everything else in the package is its inside):
  RequestDoor     the door (door.py), where every request is tokenized, checked and settled once
  LLMEngine       the step loop, with a RequestDoor over its model (`request()`)
  AsyncEngine     the same engine driven from asyncio, on an EngineLoop thread: `generate(EngineRequest)`
  EngineRequest   a request that passed the door; RequestOutput what comes back, step by step
  EngineConfig, add_engine_args, engine_config: how an engine is sized, in code and on the command line
  SamplingParams  how tokens are picked and when to stop
  Tier, TIERS     the service tiers
"""

from carpool.engine.args import add_engine_args, engine_config
from carpool.engine.async_engine import AsyncEngine, EngineLoop, EngineSnapshot
from carpool.engine.config import EngineConfig
from carpool.engine.door import ContextLengthExceeded, RequestDoor
from carpool.engine.llm_engine import LLMEngine, StepStats
from carpool.engine.outputs import RequestOutput, best_of
from carpool.engine.request import EngineRequest
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.sequence import SequenceTimes, TokenLogprob
from carpool.engine.tiers import TIERS, Tier

__all__ = [
    "TIERS",
    "AsyncEngine",
    "ContextLengthExceeded",
    "EngineConfig",
    "EngineLoop",
    "EngineRequest",
    "EngineSnapshot",
    "LLMEngine",
    "RequestDoor",
    "RequestOutput",
    "SamplingParams",
    "SequenceTimes",
    "StepStats",
    "Tier",
    "TokenLogprob",
    "add_engine_args",
    "best_of",
    "engine_config",
]
