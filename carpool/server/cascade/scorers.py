"""How sure a model was of its own answer, from the logprobs of the tokens it chose.

Every score is "higher is surer"; a cascade step accepts its answer when score >= threshold.
- `mean`: mean token logprob (the answer's per-token perplexity, negated and logged).
- `min`: the least likely token. One wrong digit in an arithmetic answer is often one unlikely token.
- `tail`: mean of the `tail_tokens` least likely tokens (default 8): like `min`, less at the mercy of one token,
  and unlike `mean` not diluted by long runs of boilerplate the model is always sure of.
- `logistic`: P(answer acceptable) from a logistic regression on the features below, fitted by
  `carpool cascade calibrate` (weights and bias live in the cascade's TOML).
"""

import math
from dataclasses import dataclass

import torch

KINDS = ("mean", "min", "tail", "logistic")
DEFAULT_TAIL_TOKENS = 8
FEATURES = ("mean", "min", "tail", "log_tokens", "hit_length")


@dataclass(frozen=True)
class Scorer:
    kind: str
    tail_tokens: int = DEFAULT_TAIL_TOKENS
    weights: tuple[float, ...] | None = None  # logistic only: one per FEATURES, then `bias`
    bias: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"scorer: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.tail_tokens, int) or self.tail_tokens < 1:
            raise ValueError(f"tail_tokens: must be a positive integer, got {self.tail_tokens!r}")
        if self.kind == "logistic" and (self.weights is None or len(self.weights) != len(FEATURES)):
            raise ValueError(
                f"weights: the logistic scorer needs {len(FEATURES)} weights ({', '.join(FEATURES)}),"
                f" got {self.weights!r} (`carpool cascade calibrate` fits them)"
            )

    def score(self, logprobs: list[float], hit_length: bool = False) -> float:
        if self.kind == "logistic":
            x = features(logprobs, hit_length, self.tail_tokens)
            return sigmoid(sum(w * f for w, f in zip(self.weights, x)) + self.bias)
        return features(logprobs, hit_length, self.tail_tokens)[FEATURES.index(self.kind)]


def sigmoid(z: float) -> float:
    """1 / (1 + e^-z) without overflow: a calibrated weight times a -20-nat empty answer can put |z| past 709."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def features(logprobs: list[float], hit_length: bool, tail_tokens: int = DEFAULT_TAIL_TOKENS) -> list[float]:
    """FEATURES of one answer. An empty answer scores as if its one token were impossible-ish (-20 nats), so it
    escalates rather than being accepted for lack of evidence."""
    values = logprobs or [-20.0]
    lowest = sorted(values)[:tail_tokens]
    return [
        sum(values) / len(values),
        lowest[0],
        sum(lowest) / len(lowest),
        math.log1p(len(logprobs)),
        float(hit_length),
    ]


def fit_logistic(
    rows: list[list[float]], labels: list[bool], steps: int = 500, l2: float = 1e-3
) -> tuple[tuple[float, ...], float]:
    """(weights, bias) of a logistic regression of labels on feature rows: full-batch L-BFGS on the mean log loss
    with a small L2 penalty (keeps the weights finite when the features separate the labels). Features are
    standardized for the fit and the weights mapped back, so the stored scorer reads raw features."""
    if len(rows) != len(labels) or not rows:
        raise ValueError(f"labels: need one label per feature row, got {len(labels)} for {len(rows)}")
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor([float(label) for label in labels], dtype=torch.float64)
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def loss():
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w * w).sum()
        value.backward()
        return value

    optimizer.step(loss)
    raw = (w / std).detach()
    return tuple(raw.tolist()), float((b - (w * mean / std).sum()).detach())
