"""The engine's door: the one place a request is tokenized, checked and settled before it may run.

`LLMEngine` holds one over its loaded model; an ingress that holds no weights (`carpool serve --replicas`) builds one
from the model's tokenizer and config and a replica's limits. Either way the same class decides, so a request a
replica would refuse is the ingress's 400 and never crosses to a replica. The door reads nothing that changes while
the engine runs, so the server calls it on its own thread and bad input never reaches the engine loop.
"""

import dataclasses
import functools

from carpool.engine.request import CacheBreakpoint, EngineRequest, check_cache_breakpoints
from carpool.engine.sampling_params import SamplingParams, check_text
from carpool.engine.structured.grammars import GrammarCompiler
from carpool.engine.tiers import BY_NAME, DEFAULT_TIER, TIER_NAMES
from carpool.models import Tokenizer
from carpool.models.config import ModelConfig
from carpool.models.loader import read_config, resolve_model_dir


class ContextLengthExceeded(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit the context window."""


class RequestDoor:
    """`max_model_len`: the context window; `max_request_tokens`: prompt plus output of one request, the context
    window or the whole KV pool if that is smaller; `cache_min_tokens`: the shortest prefix a cache breakpoint may
    pin (the price sheet's `[cache] min_tokens`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        max_request_tokens: int,
        cache_min_tokens: int,
    ):
        self.tokenizer = tokenizer
        self.cache_min_tokens = cache_min_tokens
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.max_request_tokens = max_request_tokens
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size)
        # The n choices of a request (and its retries) share their bad words: each list is tokenized once.
        self._bad_words_token_ids = functools.lru_cache(maxsize=256)(self._spell_bad_words)

    def request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        tier: str = DEFAULT_TIER,
        cache_salt: str | None = None,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ) -> EngineRequest:
        """A request that can run, settled: its tier checked, its prompt as token ids in the vocabulary, its
        `max_tokens` fixed (None: the rest of the window, as OpenAI's chat does) and fitting the window and the KV
        pool, its params naming only tokens the model has, its grammar compiled, its cache breakpoints checked (those
        shorter than cache_min_tokens dropped: such a prefix is cached and billed as any other). ValueError naming
        the field (ContextLengthExceeded when it does not fit). Nothing past the door derives any of these again."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if tier not in BY_NAME:
            raise ValueError(f"tier must be one of {', '.join(TIER_NAMES)}, got {tier!r}")
        if cache_salt is not None:  # hashed on the engine thread: a bad one would end the loop there
            if not isinstance(cache_salt, str):
                raise ValueError("cache_salt must be a string")
            check_text("cache_salt", cache_salt)
        token_ids = self.tokenize_prompt(prompt)
        self._check_vocabulary("prompt", token_ids)
        if params.max_tokens is None:
            self._check_length(len(token_ids), 1)
            params = dataclasses.replace(params, max_tokens=self.max_new_tokens(len(token_ids)))
        self._check_length(len(token_ids), params.max_tokens)
        breakpoints = check_cache_breakpoints(cache_breakpoints, len(token_ids), self.cache_min_tokens)
        bad_words = self._check_params(params)
        if params.structured is not None:  # compiled here, so a bad grammar is the caller's 400, not the loop's
            params = dataclasses.replace(params, structured=self.grammars.bind(params.structured))
        return EngineRequest(
            request_id,
            token_ids,
            params,
            tier,
            cache_salt,
            bad_words_token_ids=bad_words,
            cache_breakpoints=breakpoints,
        )

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: text through the tokenizer, token ids as given (`request()` checks them)."""
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        return token_ids

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt this long leaves room for: in the context window and in the whole KV pool."""
        return self.max_request_tokens - num_prompt_tokens

    def _check_vocabulary(self, name: str, token_ids) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _check_params(self, params: SamplingParams) -> list[list[int]]:
        """ValueError naming the field when params name a token this model does not have; params.bad_words as
        the token sequences to ban: each word as the tokenizer spells it alone and after a space."""
        self._check_vocabulary("logit_bias", params.logit_bias or ())
        self._check_vocabulary("stop_token_ids", params.stop_token_ids or ())
        return self._bad_words_token_ids(tuple(params.bad_words or ()))

    def _spell_bad_words(self, words: tuple[str, ...]) -> list[list[int]]:
        spellings = {
            tuple(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            for word in words
            for prefix in ("", " ")
        }
        return [list(ids) for ids in spellings if ids]

    def _check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens >= self.max_request_tokens:
            raise ContextLengthExceeded(
                f"prompt: {num_prompt_tokens} tokens do not fit the {self.max_request_tokens} tokens a request may "
                f"hold (context window {self.max_model_len})"
            )
        if max_tokens > self.max_new_tokens(num_prompt_tokens):
            raise ContextLengthExceeded(
                f"max_tokens: {num_prompt_tokens} prompt tokens + {max_tokens} max_tokens exceed the "
                f"{self.max_request_tokens} tokens a request may hold (context window {self.max_model_len})"
            )

    @classmethod
    def for_model_files(
        cls, model: str | None, max_model_len: int, max_request_tokens: int, cache_min_tokens: int
    ) -> "RequestDoor":
        """A door over a model's tokenizer and config alone, no weights: for an ingress in front of replicas that
        hold them (the limits are a replica's, every replica having the same config)."""
        directory = resolve_model_dir(model)
        return cls(
            Tokenizer.from_dir(directory), read_config(directory), max_model_len, max_request_tokens, cache_min_tokens
        )
