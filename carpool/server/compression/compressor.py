"""LLMLingua's prompt compression (Jiang et al., EMNLP 2023) over a small scorer model's per-token surprisal.

A prompt is a list of pieces: protected ones (a system prompt, the final question, spans the caller names) are kept
verbatim; the others are split into paragraphs (a few-shot prompt's demonstrations). The budget controller works
coarse to fine: it first keeps whole paragraphs, most surprising (highest perplexity) first, up to
COARSE_SLACK times the token budget, then compresses the survivors token by token. The token-level pass is the
paper's iterative one: windows are scored in order, each conditioned on the compressed prompt so far, and each keeps
its share of the budget as its most surprising tokens. The budget is the whole prompt's (protected tokens included),
counted by the caller's `count_tokens` (the serving model's tokenizer); when protected text alone exceeds it, only
the protected text is left.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Paragraphs kept at the coarse level, in tokens, as a multiple of the compressible budget: the token-level pass
# then removes the rest. 2 follows LLMLingua's default of handing the fine level about twice its target.
COARSE_SLACK = 2.0
WINDOW_TOKENS = 96  # tokens per window of the iterative pass (LLMLingua scores 100-token segments)
MAX_TRIMS = 4  # rounds of dropping more tokens when the re-tokenized result is still over budget


@dataclass
class Piece:
    """Text of one message (`group`) or of the whole prompt, kept verbatim when protected."""

    text: str
    protected: bool = False
    group: int = 0


@dataclass
class Budget:
    """rate: the share of the prompt's tokens to keep, in (0, 1]; or target_tokens: how many to keep."""

    rate: float | None = None
    target_tokens: int | None = None

    def __post_init__(self):
        if (self.rate is None) == (self.target_tokens is None):
            raise ValueError("prompt_compression: give exactly one of rate and target_tokens")
        if self.rate is not None and (
            isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0 < self.rate <= 1
        ):
            raise ValueError(f"prompt_compression.rate must be in (0, 1] (the share of tokens kept), got {self.rate!r}")
        if self.target_tokens is not None and (
            isinstance(self.target_tokens, bool) or not isinstance(self.target_tokens, int) or self.target_tokens < 1
        ):
            raise ValueError(f"prompt_compression.target_tokens must be a positive integer, got {self.target_tokens!r}")

    def tokens(self, original: int) -> int:
        return self.target_tokens if self.target_tokens is not None else max(1, math.floor(self.rate * original))


class Scorer:
    """What the compressor needs of a model: its tokenizer, and per-token surprisal (-logprob) of token-id prompts,
    many at once (the first token of each prompt has none: math.inf). `starts[i]`: the first position of
    prompts[i] whose surprisal is needed (default: all); the ones before it may come back math.inf, which lets
    the scorer read their KV from its prefix cache instead of computing it again."""

    tokenizer = None
    max_tokens: int = 0  # the longest prompt it scores

    async def surprisals(self, prompts: list[list[int]], starts: list[int] | None = None) -> list[list[float]]:
        raise NotImplementedError


@dataclass
class Compressed:
    texts: list[str]  # one per group, in group order
    original_tokens: int  # by count_tokens
    compressed_tokens: int
    target_tokens: int

    @property
    def kept_ratio(self) -> float:
        return self.compressed_tokens / self.original_tokens if self.original_tokens else 1.0


@dataclass
class _Unit:
    """A paragraph (or protected piece) in scorer tokens; `keep` marks the tokens the compressor keeps."""

    group: int
    protected: bool
    text: str
    ids: list[int]
    surprisal: list[float] = field(default_factory=list)
    keep: list[bool] = field(default_factory=list)


async def compress(
    pieces: list[Piece], budget: Budget, scorer: Scorer, count_tokens: Callable[[list[str]], int] | None = None
) -> Compressed:
    tokenizer = scorer.tokenizer
    count = count_tokens or (lambda texts: sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts))
    groups = sorted({p.group for p in pieces})
    original_texts = ["".join(p.text for p in pieces if p.group == g) for g in groups]
    original = count(original_texts)
    target = budget.tokens(original)
    if target >= original:
        return Compressed(original_texts, original, original, target)
    units = [
        _Unit(p.group, p.protected, text, tokenizer.encode(text, add_special_tokens=False))
        for piece in pieces
        for p, text in _paragraphs(piece)
        if text
    ]
    compressible = [u for u in units if not u.protected]
    # The budget in the scorer's tokens: the serving model's tokenizer may cut the same text finer or coarser.
    scale = sum(len(u.ids) for u in units) / original
    budget_tokens = max(0, math.floor((target - count([u.text for u in units if u.protected])) * scale))
    await _keep_paragraphs(compressible, budget_tokens, scorer)
    await _keep_tokens(units, budget_tokens, scorer)
    texts = _render(units, groups, tokenizer)
    for _ in range(MAX_TRIMS):  # decoding dropped tokens and encoding again can merge or split a few
        excess = count(texts) - target
        if excess <= 0 or not _drop_least_surprising(compressible, excess):
            break
        texts = _render(units, groups, tokenizer)
    return Compressed(texts, original, count(texts), target)


def scoring_bound(pieces: list[Piece], scorer: Scorer) -> int:
    """An upper bound of the tokens compress() has `scorer` read (prompts plus their one output token each), for
    the gate to reserve before the work starts. The coarse pass reads each compressible paragraph once; the
    iterative pass reads each window after everything before it (protected text and kept tokens), so its j-th
    window is at most all protected tokens plus the first min(C, WINDOW_TOKENS * j) compressible ones. A protected
    piece cuts a window short, so there are at most ceil(C / WINDOW_TOKENS) windows plus one per protected piece."""
    sizes = [
        (p.protected, len(scorer.tokenizer.encode(text, add_special_tokens=False)))
        for piece in pieces
        for p, text in _paragraphs(piece)
        if text
    ]
    protected = sum(size for is_protected, size in sizes if is_protected)
    compressible = [size for is_protected, size in sizes if not is_protected]
    total = sum(compressible)
    if not total:
        return 0
    windows = -(-total // WINDOW_TOKENS) + sum(1 for is_protected, _ in sizes if is_protected)
    fine = sum(min(scorer.max_tokens, protected + min(total, WINDOW_TOKENS * j)) for j in range(1, windows + 1))
    return total + len(compressible) + fine + windows


def _paragraphs(piece: Piece):
    """A compressible piece's paragraphs, each with the blank line after it (a few-shot prompt's demonstrations
    are paragraphs), or its lines when it has no blank line (a transcript's turns); a protected piece whole."""
    if piece.protected:
        yield piece, piece.text
        return
    separator = "\n\n" if "\n\n" in piece.text else "\n"
    rest = piece.text
    while rest:
        cut = rest.find(separator)
        end = len(rest) if cut < 0 else len(rest) - len(rest[cut:].lstrip("\n"))
        yield piece, rest[:end]
        rest = rest[end:]


async def _keep_paragraphs(units: list[_Unit], budget_tokens: int, scorer: Scorer) -> None:
    """Coarse level: paragraphs by perplexity, each scored alone in one batch, kept while they fit
    COARSE_SLACK x budget, and until they hold the budget (the token level then has enough to choose from)."""
    total = sum(len(u.ids) for u in units)
    for unit in units:
        unit.keep = [True] * len(unit.ids)
    if total <= COARSE_SLACK * budget_tokens or len(units) < 2:
        return
    scores = await scorer.surprisals([_fit(u.ids, scorer) for u in units])
    perplexity = [_mean_finite(s) for s in scores]
    kept = 0
    for i in sorted(range(len(units)), key=lambda i: -perplexity[i]):
        size = len(units[i].ids)
        if kept < budget_tokens or kept + size <= COARSE_SLACK * budget_tokens:
            kept += size
        else:
            units[i].keep = [False] * size


async def _keep_tokens(units: list[_Unit], budget_tokens: int, scorer: Scorer) -> None:
    """Fine level, iterative: windows of kept text (across paragraphs, up to WINDOW_TOKENS) are scored in order,
    each after the compressed prompt before it, and each keeps its share of what is left of the budget as its
    most surprising tokens (ties: the earlier token)."""
    left = sum(sum(u.keep) for u in units if not u.protected)
    quota_left = min(budget_tokens, left)
    prefix: list[int] = []
    window: list[tuple[_Unit, int]] = []  # (unit, position) of the kept tokens waiting to be scored
    # A window is scored whole: a scorer whose context is shorter than WINDOW_TOKENS (a server started with
    # --max-model-len 64, found by schemathesis) gets shorter windows, not surprisals for only part of one.
    window_tokens = min(WINDOW_TOKENS, scorer.max_tokens)

    async def score_window():
        nonlocal left, quota_left, prefix
        ids = [unit.ids[i] for unit, i in window]
        quota = round(quota_left * len(ids) / left)
        left, quota_left = left - len(ids), quota_left - quota
        # Only the window is scored: the compressed prefix was the previous window's prompt up to its kept tokens,
        # so its KV is mostly in the scorer's prefix cache (LLMLingua keeps the scorer's KV between windows too).
        prompt = _fit(prefix + ids, scorer)
        surprisal = (await scorer.surprisals([prompt], [len(prompt) - len(ids)]))[0][-len(ids) :]
        chosen = set(sorted(range(len(ids)), key=lambda j: (-surprisal[j], j))[:quota])
        for j, (unit, i) in enumerate(window):
            unit.keep[i] = j in chosen
            unit.surprisal.append((i, surprisal[j]))
        prefix += [ids[j] for j in sorted(chosen)]
        window.clear()

    for unit in units:
        if unit.protected:
            if window:
                await score_window()
            prefix += unit.ids
            continue
        for i in (i for i, k in enumerate(unit.keep) if k):
            window.append((unit, i))
            if len(window) == window_tokens:
                await score_window()
    if window:
        await score_window()


def _drop_least_surprising(units: list[_Unit], count: int) -> bool:
    """Drop `count` more of the kept, scored tokens (least surprising first); False when none is left to drop."""
    kept = [(s, u, i) for u in units for i, s in u.surprisal if u.keep[i]]
    for _, unit, i in sorted(kept, key=lambda t: t[0])[:count]:
        unit.keep[i] = False
    return bool(kept)


def _render(units: list[_Unit], groups: list[int], tokenizer) -> list[str]:
    texts = []
    for group in groups:
        parts = []
        for unit in (u for u in units if u.group == group):
            parts.append(
                unit.text if unit.protected else tokenizer.decode([t for t, k in zip(unit.ids, unit.keep) if k])
            )
        texts.append("".join(parts))
    return texts


def _fit(ids: list[int], scorer: Scorer) -> list[int]:
    """The prompt's last tokens that the scorer's context holds (the tokens that matter are at the end)."""
    return ids[-scorer.max_tokens :] if len(ids) > scorer.max_tokens else ids


def _mean_finite(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else 0.0
