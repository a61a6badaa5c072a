"""Offline batch inference: `LLM(...).generate(prompts, params)`."""

import dataclasses
import itertools

from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.outputs import RequestOutput, best_of
from carpool.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order. A single prompt may be passed bare. A prompt whose
        params ask for best_of runs that many candidates (seeds seed, seed + 1, ...) and returns the best."""
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} SamplingParams for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params must be SamplingParams")
        request_ids, candidates = [], []
        try:
            for prompt, p in zip(prompts, params):
                candidates.append([])
                for k in range(p.best_of):
                    request_id = f"offline-{next(self._ids)}"
                    seed = None if p.seed is None else p.seed + k
                    self.engine.add_request(request_id, prompt, dataclasses.replace(p, seed=seed))
                    request_ids.append(request_id)
                    candidates[-1].append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [best_of([finished[r] for r in ids])[0] for ids in candidates]

    def chat_prompt(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
