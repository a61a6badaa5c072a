import math
from dataclasses import dataclass, field
from functools import cached_property

from carpool.engine.structured.spec import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value, either sign
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty, either sign
# Below this temperature sampling is greedy (vLLM's threshold): the softmax of logits / 1e-5 is already one-hot
# to float32, and dividing by 1e-45 or 1e-320 (zero once in float32) turned every row into NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Invalid values raise ValueError naming the field.

    Penalties follow OpenAI (presence_penalty, frequency_penalty: over the generated tokens) and vLLM/HF
    (repetition_penalty: over prompt and generated tokens, positive logits divided by it, negative multiplied).
    logit_bias maps token id -> a value in [-100, 100] added to its logit. min_tokens holds back EOS and
    stop_token_ids (and stop strings) until that many tokens are out. bad_words: a token that would complete
    one of these words (as the tokenizer spells it, with or without a leading space) is never picked.
    best_of: generate this many candidates and keep the one with the highest cumulative logprob.
    structured: what the output must match (a JSON schema, regex, choice or grammar); None: unconstrained.
    It excludes min_tokens and bad_words, which could ban every token the grammar allows.
    """

    max_tokens: int | None = 16  # None: the rest of the context window, settled at the engine's door
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; k: plus the top k alternatives
    # vLLM's extension: each prompt token's logprob given the tokens before it (the first has none), plus the top
    # k alternatives. A prefix-cache hit has no logits to read, so such a request computes its prompt from
    # prompt_logprobs_start - 1 on: the tokens before prompt_logprobs_start get no logprob (None), and only their
    # KV may come from the prefix cache (an iterative scorer scoring a new window after a prefix it scored before).
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    best_of: int = 1
    structured: StructuredOutput | None = None
    speculative: bool = True  # False: this request never speculates (the engine's drafter sits it out)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.stop_strings = _strings("stop", self.stop)
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        if self.stop_token_ids is not None and not _token_ids(self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not _is_int(self.prompt_logprobs_start) or self.prompt_logprobs_start < 1:
            raise ValueError(f"prompt_logprobs_start must be an integer >= 1, got {self.prompt_logprobs_start!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            self._check_logit_bias()
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        self.bad_words = _strings("bad_words", self.bad_words) or None
        if any(not word.strip() for word in self.bad_words or ()):
            raise ValueError("bad_words must not be empty or blank")
        if not _is_int(self.best_of) or self.best_of < 1:
            raise ValueError(f"best_of must be a positive integer, got {self.best_of!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        # Both ban tokens before the grammar's mask: when they ban every token the grammar allows, the row is all
        # -inf and token 0 comes out (measured: guided_choice ["yes"] with min_tokens 8 gave "yes!!!!!!!", "stop").
        for name in ("min_tokens", "bad_words") if self.structured is not None else ():
            if getattr(self, name):
                raise ValueError(f"{name} cannot be combined with a structured output constraint")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict) or not _token_ids(list(self.logit_bias)):
            raise ValueError("logit_bias must map non-negative integer token ids to numbers")
        for token, bias in self.logit_bias.items():
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: the bias of token {token} must be in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @cached_property
    def logit_bias_columns(self) -> tuple[list[int], list[float]]:
        """logit_bias as (token ids, biases), made once per request rather than on each of its steps."""
        return list(self.logit_bias or ()), list((self.logit_bias or {}).values())

    @property
    def ranked(self) -> bool:
        """Whether the engine must keep the output's cumulative logprob (to pick the best of several)."""
        return self.best_of > 1


def check_text(name: str, text: str) -> None:
    """ValueError naming `name` when `text` is not valid Unicode (a lone UTF-16 surrogate, such as JSON's
    "\\ud800", survives json.loads but no tokenizer or UTF-8 encoder accepts it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{name}: contains a lone UTF-16 surrogate ({text[error.start]!a}) at character "
            f"{error.start}, which is not valid Unicode text"
        ) from None


def _strings(name: str, value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    elif not (isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value)):
        raise ValueError(f"{name} must be a string or a list of strings, got {type(value).__name__}")
    for text in value:
        check_text(name, text)
    return list(value)


def _token_ids(values) -> bool:
    return isinstance(values, (list, tuple)) and all(_is_int(t) and t >= 0 for t in values)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _is_finite(value) -> bool:
    return _is_number(value) and math.isfinite(value)
