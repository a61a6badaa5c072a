"""Thresholds for a cascade from scored answers: the cheapest that meet a target accuracy (or agreement with the
strongest model), found by replaying the cascade over every model's recorded answers.

Replaying is exact for greedy decoding: a step's answer does not depend on whether the cascade reached it, so one
run of each model on the set prices every threshold at once.
"""

import itertools
import math
from dataclasses import dataclass, replace

from carpool.server.cascade.config import Cascade
from carpool.server.cascade.router import Router, first_reaching
from carpool.server.cascade.runs import Attempt, Example, same_answer
from carpool.server.cascade.scorers import Scorer, features, fit_logistic

MAX_CANDIDATES_PER_STEP = 64  # thresholds tried per step: a full grid for two steps, 64^2 for three
# The router's L2 penalty (on standardized features): its 259 features outnumber the ~100 labelled prompts of a
# calibration split, which the scorers' 1e-3 would let it memorise.
ROUTER_L2 = 0.05


@dataclass
class Table:
    """Per step s (the cascade's order) and example i: the step's score, cost and whether its answer is right."""

    scores: list[list[float]]
    costs: list[list[float]]
    right: list[list[bool]]
    overhead: list[float] | None = None  # paid per example whatever runs after (a prompt-pass router's pass)

    @property
    def size(self) -> int:
        return len(self.costs[0])


@dataclass(frozen=True)
class Outcome:
    thresholds: tuple[float, ...]
    accuracy: float
    cost: float  # mean dollars per example
    shares: tuple[float, ...]  # share of examples answered by each step
    route_thresholds: tuple[float, ...] = ()  # a router's, when the outcome is of a router


def labels(examples: list[Example], attempts: list[list[Attempt]], agreement: bool) -> list[list[bool]]:
    """right[s][i]: step s's answer matches example i's label, or with `agreement` the last model's answer."""
    if agreement:
        return [[same_answer(a.text, last.text) for a, last in zip(step, attempts[-1])] for step in attempts]
    missing = sum(example.answer is None for example in examples)
    if missing:
        raise ValueError(f"data: {missing} examples have no `answer`; use --target-agreement for unlabeled data")
    return [[same_answer(a.text, e.answer) for a, e in zip(step, examples)] for step in attempts]


def fit_scorers(cascade: Cascade, attempts: list[list[Attempt]], right: list[list[bool]]) -> Cascade:
    """The cascade with each logistic step's weights fitted to predict that step's answer is right."""
    steps = list(cascade.steps)
    for s, step in enumerate(steps[:-1]):
        if step.scorer.kind == "logistic":
            rows = [features(a.logprobs, a.hit_length, step.scorer.tail_tokens) for a in attempts[s]]
            weights, bias = fit_logistic(rows, right[s])
            steps[s] = replace(step, scorer=replace(step.scorer, weights=weights, bias=bias))
    return replace(cascade, steps=tuple(steps))


def table(cascade: Cascade, attempts: list[list[Attempt]], right: list[list[bool]]) -> Table:
    scorers: list[Scorer | None] = [step.scorer for step in cascade.steps]
    scores = [
        [scorer.score(a.logprobs, a.hit_length) if scorer else math.inf for a in step]
        for scorer, step in zip(scorers, attempts)
    ]
    return Table(scores, [[a.cost for a in step] for step in attempts], right)


def replay(data: Table, thresholds: tuple[float, ...], starts: list[int] | None = None) -> Outcome:
    """The cascade over every example: step s answers when its score >= thresholds[s] (the last step always).
    `starts`: the step each example begins at (a router's choice); the steps before it are neither run nor paid."""
    steps = len(data.costs)
    answered, cost, right = [0] * steps, sum(data.overhead or ()), 0
    for i in range(data.size):
        for s in range(starts[i] if starts else 0, steps):
            cost += data.costs[s][i]
            if s == steps - 1 or data.scores[s][i] >= thresholds[s]:
                answered[s] += 1
                right += data.right[s][i]
                break
    n = data.size
    return Outcome(thresholds, right / n, cost / n, tuple(a / n for a in answered))


def candidates(scores: list[float]) -> list[float]:
    """-inf (always accept), +inf (always escalate) and up to MAX_CANDIDATES_PER_STEP observed scores between."""
    distinct = sorted(set(scores))
    if len(distinct) > MAX_CANDIDATES_PER_STEP:
        stride = len(distinct) / MAX_CANDIDATES_PER_STEP
        distinct = [distinct[int(k * stride)] for k in range(MAX_CANDIDATES_PER_STEP)]
    return [-math.inf, *distinct, math.inf]


def sweep(data: Table) -> list[Outcome]:
    """Every candidate threshold combination's outcome."""
    grids = [candidates(scores) for scores in data.scores[:-1]]
    return [replay(data, thresholds) for thresholds in itertools.product(*grids)]


@dataclass
class Passes:
    """The cheapest model's prompt pass over every example, for a prompt-pass router."""

    surprisals: list[list[float]]
    costs: list[float]  # each pass's own
    reused_costs: list[float]  # the cheapest model's attempt when it reads the pass's KV (runs.reused_cost)


def routed_table(router: Router, data: Table, passes: Passes | None) -> Table:
    """The table a router's outcomes are priced on: a prompt-pass router pays for every pass, and its cheapest
    model's attempts read their prompts' KV from the cache the pass wrote."""
    if not router.reads_prompt_pass:
        return data
    if passes is None:
        raise ValueError(f"router {router.name!r}: features: 'prompt-pass' needs the cheapest model's prompt passes")
    return Table(data.scores, [passes.reused_costs, *data.costs[1:]], data.right, passes.costs)


def _surprisals(router: Router, passes: Passes | None, size: int) -> list[list[float] | None]:
    return passes.surprisals if router.reads_prompt_pass and passes is not None else [None] * size


def fit_router(
    router: Router, examples: list[Example], right: list[list[bool]], passes: Passes | None = None
) -> Router:
    """The router with each classifier fitted to predict that its model's answer to a prompt is right."""
    surprisals = _surprisals(router, passes, len(examples))
    rows = [router.features_of(example.prompt, s) for example, s in zip(examples, surprisals)]
    fitted = [fit_logistic(rows, right[k], l2=ROUTER_L2) for k in range(len(router.models) - 1)]
    return replace(router, weights=tuple(w for w, _ in fitted), bias=tuple(b for _, b in fitted))


def route_scores(router: Router, examples: list[Example], passes: Passes | None = None) -> list[list[float]]:
    """scores[k][i]: the router's P(models[k] answers example i right)."""
    surprisals = _surprisals(router, passes, len(examples))
    per_example = [router.scores(example.prompt, s) for example, s in zip(examples, surprisals)]
    return [list(column) for column in zip(*per_example)]


def sweep_router(data: Table, scores: list[list[float]], cascade_grid: list[tuple[float, ...]]) -> list[Outcome]:
    """Every candidate router threshold combination's outcome, each with every cascade thresholds of
    `cascade_grid` after the routed-to step ((-inf, ...) alone: the routed-to model answers)."""
    outcomes = []
    for route in itertools.product(*(candidates(column) for column in scores)):
        starts = [first_reaching([column[i] for column in scores], route) for i in range(data.size)]
        outcomes += [replace(replay(data, cascade, starts), route_thresholds=route) for cascade in cascade_grid]
    return outcomes


def accept_all(data: Table) -> list[tuple[float, ...]]:
    """The one cascade thresholds that accept every step's answer: a router without a cascade."""
    return [(-math.inf,) * (len(data.costs) - 1)]


def cascade_grid(data: Table) -> list[tuple[float, ...]]:
    return list(itertools.product(*(candidates(scores) for scores in data.scores[:-1])))


def most_accurate_within(outcomes: list[Outcome], budget: float) -> Outcome | None:
    """The most accurate outcome costing at most `budget` (ties: the cheaper); None when none does."""
    within = [o for o in outcomes if o.cost <= budget + 1e-15]
    return max(within, key=lambda o: (o.accuracy, -o.cost)) if within else None


def cheapest_meeting(outcomes: list[Outcome], target: float) -> Outcome:
    """The lowest-cost outcome with accuracy >= target (ties: the more accurate). ValueError when none does."""
    meeting = [o for o in outcomes if o.accuracy >= target - 1e-12]
    if not meeting:
        best = max(o.accuracy for o in outcomes)
        raise ValueError(f"target: {target:.3f} is above the best this cascade reaches on the data ({best:.3f})")
    return min(meeting, key=lambda o: (o.cost, -o.accuracy))


def with_thresholds(cascade: Cascade, thresholds: tuple[float, ...]) -> Cascade:
    """Infinite thresholds (always accept / always escalate) are stored as the nearest finite score edge."""
    steps = list(cascade.steps)
    for s, threshold in enumerate(thresholds):
        steps[s] = replace(steps[s], threshold=_finite(threshold))
    return replace(cascade, steps=tuple(steps))


def with_route_thresholds(router: Router, thresholds: tuple[float, ...]) -> Router:
    return replace(router, thresholds=tuple(_finite(t) for t in thresholds))


def _finite(threshold: float) -> float:
    return max(min(threshold, 1e9), -1e9)
