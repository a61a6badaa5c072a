"""The routers over a cascade's models, beside the cascade, on one scored set: each router alone (the routed-to
model answers) and with the cascade (route, then escalate a low-scoring answer), as every threshold's outcome
(the curves) and as configured (the points). Replayed from the same recorded answers as the cascade."""

from dataclasses import dataclass

from carpool.server.cascade import calibrate
from carpool.server.cascade.config import Cascade
from carpool.server.cascade.router import Router, first_reaching
from carpool.server.cascade.runs import Example

EQUAL_ACCURACY_MARGIN = 0.01  # "equal accuracy": within 1 point of the last model alone
COST_SHARE = 0.6  # "at 60% of the last model's cost"


@dataclass
class Curve:
    label: str
    outcomes: list[calibrate.Outcome]  # every threshold's
    point: calibrate.Outcome | None  # the configured (calibrated) thresholds'


def routers_of(cascades: dict, cascade: Cascade) -> list[Router]:
    """The file's routers over exactly the cascade's models, in the file's order."""
    return [r for r in cascades.values() if isinstance(r, Router) and list(r.models) == cascade.models]


def fit_routers(
    cascades: dict,
    cascade: Cascade,
    examples: list[Example],
    data: calibrate.Table,
    target: float,
    passes: calibrate.Passes | None = None,
) -> dict[str, Router]:
    """Each router over the cascade's models, its classifiers fitted and its thresholds the cheapest meeting
    `target` (with its own `cascade`'s thresholds, as the file has them, after the routed-to step); a prompt-pass
    router's cost counts its passes."""
    fitted = {}
    for router in routers_of(cascades, cascade):
        router = calibrate.fit_router(router, examples, data.right, passes)
        grid = _configured_grid(cascades, router, data)
        routed = calibrate.routed_table(router, data, passes)
        outcomes = calibrate.sweep_router(routed, calibrate.route_scores(router, examples, passes), grid)
        chosen = calibrate.cheapest_meeting(outcomes, target)
        fitted[router.name] = calibrate.with_route_thresholds(router, chosen.route_thresholds)
    return fitted


def curves(
    cascades: dict,
    cascade: Cascade,
    examples: list[Example],
    data: calibrate.Table,
    passes: calibrate.Passes | None = None,
) -> list[Curve]:
    """The cascade's, then per router over its models: the router alone and the router with this cascade (a
    prompt-pass router's costs with its passes)."""
    thresholds = tuple(step.threshold for step in cascade.steps[:-1])
    result = [Curve(f"cascade {cascade.name}", calibrate.sweep(data), calibrate.replay(data, thresholds))]
    everywhere = calibrate.cascade_grid(data)
    for router in routers_of(cascades, cascade):
        if router.weights is None:
            continue  # not calibrated yet: nothing to draw
        scores = calibrate.route_scores(router, examples, passes)
        routed = calibrate.routed_table(router, data, passes)
        starts = [first_reaching([column[i] for column in scores], router.thresholds) for i in range(data.size)]
        alone = calibrate.replay(routed, calibrate.accept_all(data)[0], starts)
        with_cascade = calibrate.replay(routed, thresholds, starts)
        configured = router.cascade == cascade.name
        result += [
            Curve(
                f"router {router.name}",
                calibrate.sweep_router(routed, scores, calibrate.accept_all(data)),
                None if configured else alone,
            ),
            Curve(
                f"router {router.name} + cascade",
                calibrate.sweep_router(routed, scores, everywhere),
                with_cascade if configured else None,
            ),
        ]
    return result


def _configured_grid(cascades: dict, router: Router, data: calibrate.Table) -> list[tuple[float, ...]]:
    if router.cascade is None:
        return calibrate.accept_all(data)
    return [tuple(step.threshold for step in cascades[router.cascade].steps[:-1])]


def goal_points(curve: Curve, last_accuracy: float, last_cost: float) -> dict:
    """The issue's two figures on a curve's every threshold (hindsight: the most any calibration could give):
    the cost at equal accuracy and the accuracy at COST_SHARE of the last model's cost."""
    try:
        equal = calibrate.cheapest_meeting(curve.outcomes, last_accuracy - EQUAL_ACCURACY_MARGIN)
    except ValueError:
        equal = None
    within = calibrate.most_accurate_within(curve.outcomes, COST_SHARE * last_cost)
    return {
        "cost_at_equal_accuracy": None if equal is None else equal.cost / last_cost,
        "accuracy_at_equal_accuracy": None if equal is None else equal.accuracy,
        "accuracy_at_cost_share": None if within is None else within.accuracy,
    }
