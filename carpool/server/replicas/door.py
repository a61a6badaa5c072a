"""The engine's door for an ingress that holds no weights: LLMEngine's own checks (the same methods, borrowed,
so there is one door), over the model's tokenizer and config and the replicas' limits."""

import functools

from carpool.engine.llm_engine import LLMEngine
from carpool.engine.structured.grammars import GrammarCompiler
from carpool.models import Tokenizer
from carpool.models.loader import read_config, resolve_model_dir


class RequestDoor:
    """`request()` checks and tokenizes exactly as a replica's LLMEngine would, so a bad request is the ingress's
    400 and never crosses to a replica. `limits`: a replica's `limits()` (every replica has the same config)."""

    request = LLMEngine.request
    tokenize_prompt = LLMEngine.tokenize_prompt
    max_new_tokens = LLMEngine.max_new_tokens
    _check_vocabulary = LLMEngine._check_vocabulary
    _check_params = LLMEngine._check_params
    _check_length = LLMEngine._check_length
    _spell_bad_words = LLMEngine._spell_bad_words

    def __init__(self, model: str | None, limits: dict, cache_min_tokens: int):
        directory = resolve_model_dir(model)
        self.model_config = read_config(directory)
        self.tokenizer = Tokenizer.from_dir(directory)
        self.max_model_len = limits["max_model_len"]
        self.max_request_tokens = limits["max_request_tokens"]
        self.cache_min_tokens = cache_min_tokens  # the price sheet's, set on the ingress's config by open_gate
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._bad_words_token_ids = functools.lru_cache(maxsize=256)(self._spell_bad_words)
