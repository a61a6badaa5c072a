"""Routers (RouteLLM, Ong et al. 2024): pick the model from the prompt alone, before any model answers, so a prompt
sent to the strong model never pays for a cheap attempt first.

    [[router]]
    name = "support"                  # what clients pass as `model`
    models = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]   # cheapest first, two or more served models
    thresholds = [0.62]               # route to models[k] when P(models[k] answers right) >= thresholds[k]
    weights = [[...]]                 # per model but the last: feature_count(features) weights (`calibrate`)
    bias = [-0.3]
    cascade = "qwen-cascade"          # optional: a cascade of the same models, continued from the routed-to step
    features = "words"                # or "prompt-pass": also the cheapest model's surprisal of the prompt

The classifier is a logistic regression over the prompt's words and word pairs hashed into BUCKETS counts, plus its
length and count of numbers: a pure function of the text, so one prompt and one threshold always route alike.
With `features = "prompt-pass"` it also reads statistics of the cheapest model's per-token surprisal of the chat
prompt (one prefill of it, billed; that model, when chosen, reads the prompt's KV back from its prefix cache).
Every mistake is a ValueError naming the router and the field.
"""

import itertools
import math
import re
import zlib
from dataclasses import dataclass

from carpool.server.cascade.scorers import sigmoid

BUCKETS = 256  # hashed word and word-pair counts; a few hundred labelled prompts fit no more
_EXTRAS = ("log_chars", "log_words", "log_numbers")
FEATURE_COUNT = BUCKETS + len(_EXTRAS)
FEATURE_SETS = ("words", "prompt-pass")
TAIL_TOKENS = 32  # the prompt's end: the user's message and the template's closing, not the fixed system prompt
_PASS_STATS = ("mean", "std", "max", "tail_mean", "tail_max", "log_tokens")
DEFAULT_THRESHOLD = 0.5
_TOKEN = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
_FIELDS = {"name", "models", "thresholds", "weights", "bias", "cascade", "features"}


def prompt_features(text: str) -> list[float]:
    """log1p of each bucket's count of words and adjacent word pairs (every number one word, `0`: the digits say
    little, how many numbers a prompt holds says much), then log1p of characters, words and numbers. crc32, not
    Python's salted hash(): the buckets must be the same in every process."""
    words = ["0" if word.isdigit() else word for word in _TOKEN.findall(text.casefold())]
    counts = [0] * BUCKETS
    for gram in words + [f"{a} {b}" for a, b in itertools.pairwise(words)]:
        counts[zlib.crc32(gram.encode()) % BUCKETS] += 1
    numbers = sum(word == "0" for word in words)
    return [math.log1p(c) for c in counts] + [math.log1p(len(text)), math.log1p(len(words)), math.log1p(numbers)]


def pass_features(surprisals: list[float]) -> list[float]:
    """Statistics of a model's surprisal (nats) of each prompt token after the first: mean, spread and peak, the
    same of the last TAIL_TOKENS, and log1p of the count."""
    if not surprisals:
        return [0.0] * len(_PASS_STATS)
    mean = sum(surprisals) / len(surprisals)
    std = math.sqrt(sum((s - mean) ** 2 for s in surprisals) / len(surprisals))
    tail = surprisals[-TAIL_TOKENS:]
    return [mean, std, max(surprisals), sum(tail) / len(tail), max(tail), math.log1p(len(surprisals))]


def feature_count(features: str) -> int:
    return FEATURE_COUNT + (len(_PASS_STATS) if features == "prompt-pass" else 0)


@dataclass(frozen=True)
class Router:
    name: str
    models: tuple[str, ...]
    thresholds: tuple[float, ...]  # one per model but the last
    weights: tuple[tuple[float, ...], ...] | None = None  # None until calibrated: such a router cannot be served
    bias: tuple[float, ...] = ()
    cascade: str | None = None
    features: str = "words"  # one of FEATURE_SETS

    @property
    def reads_prompt_pass(self) -> bool:
        return self.features == "prompt-pass"

    def features_of(self, text: str, surprisals: list[float] | None = None) -> list[float]:
        """The classifier's input; `surprisals`: models[0]'s of the chat prompt's tokens after the first, which
        a prompt-pass router needs."""
        if not self.reads_prompt_pass:
            return prompt_features(text)
        if surprisals is None:
            raise ValueError(f"router {self.name!r}: features: 'prompt-pass' needs the prompt's surprisals")
        return prompt_features(text) + pass_features(surprisals)

    def scores(self, text: str, surprisals: list[float] | None = None) -> list[float]:
        """P(models[k] answers right) for each model but the last."""
        if self.weights is None:
            raise ValueError(f"router {self.name!r}: weights: not calibrated (`carpool cascade calibrate` fits them)")
        x = self.features_of(text, surprisals)
        return [sigmoid(sum(w * f for w, f in zip(weights, x)) + b) for weights, b in zip(self.weights, self.bias)]

    def route(self, text: str, surprisals: list[float] | None = None) -> int:
        """Index of the first model whose score reaches its threshold; the last model otherwise."""
        return first_reaching(self.scores(text, surprisals), self.thresholds)


def first_reaching(scores: list[float], thresholds: tuple[float, ...]) -> int:
    return next((k for k, (s, t) in enumerate(zip(scores, thresholds)) if s >= t), len(scores))


def parse_router(table: dict, where: str, served: list[str] | None, cascades: dict) -> Router:
    """One [[router]] table; `cascades`: the file's cascades, which `cascade` may name."""
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: must be a non-empty string")
    where = f"{where} ({name!r})"
    unknown = set(table) - _FIELDS
    if unknown:
        raise ValueError(f"{where}.{min(unknown)}: unknown field (known: {', '.join(sorted(_FIELDS))})")
    features = table.get("features", "words")
    if features not in FEATURE_SETS:
        raise ValueError(f"{where}.features: must be one of {', '.join(map(repr, FEATURE_SETS))}, got {features!r}")
    if served is not None and name in served:
        raise ValueError(f"{where}.name: {name!r} is already a served model's name")
    if name in cascades:
        raise ValueError(f"{where}.name: {name!r} is already a cascade's name")
    models = table.get("models")
    if not isinstance(models, list) or len(models) < 2 or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"{where}.models: a router needs a list of two or more served models' names")
    for model in models:
        if served is not None and model not in served:
            raise ValueError(f"{where}.models: {model!r} is not served (served: {', '.join(served)})")
    thresholds = _numbers(table.get("thresholds", [DEFAULT_THRESHOLD] * (len(models) - 1)), f"{where}.thresholds")
    if len(thresholds) != len(models) - 1:
        raise ValueError(f"{where}.thresholds: one per model but the last ({len(models) - 1}), got {len(thresholds)}")
    weights, bias = table.get("weights"), table.get("bias")
    if weights is None:
        if bias is not None:
            raise ValueError(f"{where}.bias: given without weights")
        if served is not None:
            raise ValueError(f"{where}.weights: not calibrated; `carpool cascade calibrate` fits them")
    else:
        if not isinstance(weights, list) or len(weights) != len(models) - 1:
            raise ValueError(f"{where}.weights: one list per model but the last ({len(models) - 1})")
        weights = tuple(_numbers(w, f"{where}.weights[{k}]") for k, w in enumerate(weights))
        count = feature_count(features)
        if any(len(w) != count for w in weights):
            raise ValueError(f"{where}.weights: each list needs {count} numbers with features = {features!r}")
        bias = _numbers(bias, f"{where}.bias")
        if len(bias) != len(weights):
            raise ValueError(f"{where}.bias: one per model but the last ({len(weights)}), got {len(bias)}")
    cascade = table.get("cascade")
    if cascade is not None:
        if cascade not in cascades:
            raise ValueError(f"{where}.cascade: {cascade!r} is not a cascade of this file")
        if cascades[cascade].models != list(models):
            raise ValueError(f"{where}.cascade: {cascade!r} has models {cascades[cascade].models}, not {models}")
    return Router(name, tuple(models), thresholds, weights, bias or (), cascade, features)


def _numbers(value, where: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value
    ):
        raise ValueError(f"{where}: must be a list of finite numbers")
    return tuple(float(v) for v in value)


def dump_router(router: Router, string) -> list[str]:
    """TOML lines that parse_router reads back as `router` (`string`: the file's string quoting)."""
    lines = [
        "[[router]]",
        f"name = {string(router.name)}",
        f"models = [{', '.join(string(m) for m in router.models)}]",
        f"thresholds = [{', '.join(repr(t) for t in router.thresholds)}]",
    ]
    if router.cascade is not None:
        lines.append(f"cascade = {string(router.cascade)}")
    if router.features != "words":
        lines.append(f"features = {string(router.features)}")
    if router.weights is not None:
        rows = ",\n  ".join("[" + ", ".join(repr(w) for w in weights) + "]" for weights in router.weights)
        lines += [f"weights = [\n  {rows},\n]", f"bias = [{', '.join(repr(b) for b in router.bias)}]"]
    return lines
