"""The cost-vs-accuracy curves of a cascade's thresholds (and of the routers over its models), with each single
model as a point."""

from pathlib import Path

from carpool.server.cascade.calibrate import Outcome
from carpool.server.cascade.compare import Curve

_COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink")


def frontier(outcomes: list[Outcome]) -> list[Outcome]:
    """The outcomes no other beats on both cost and accuracy, cheapest first."""
    best, points = -1.0, []
    for outcome in sorted(outcomes, key=lambda o: (o.cost, -o.accuracy)):
        if outcome.accuracy > best:
            points.append(outcome)
            best = outcome.accuracy
    return points


def draw_curve(
    path: str | Path,
    title: str,
    curves: list[Curve],
    singles: dict[str, tuple[float, float]],
    metric: str = "accuracy",
) -> None:
    """`curves`: the cascade's first (its every threshold drawn as grey dots), then the routers'; each curve's
    frontier as a line and its configured point as a star. `singles`: {model: (mean cost, accuracy)}. Costs are
    drawn in dollars per 1,000 requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_k = 1000.0
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    outcomes = curves[0].outcomes
    ax.scatter(
        [o.cost * per_k for o in outcomes],
        [o.accuracy for o in outcomes],
        s=6,
        color="0.75",
        label="cascade, each threshold",
    )
    drawn: list[tuple[list[Outcome], str]] = []
    for curve in curves:
        # Two routers over the same models fit the same classifier: one line, each router's star on it.
        color = next((c for outcomes, c in drawn if outcomes == curve.outcomes), None)
        if color is None:
            color = _COLORS[len(drawn) % len(_COLORS)]
            drawn.append((curve.outcomes, color))
            edge = frontier(curve.outcomes)
            ax.plot([o.cost * per_k for o in edge], [o.accuracy for o in edge], color=color, label=curve.label)
        if curve.point is not None:
            ax.scatter([curve.point.cost * per_k], [curve.point.accuracy], s=120, marker="*", color=color, zorder=4)
    for model, (cost, accuracy) in singles.items():
        ax.scatter([cost * per_k], [accuracy], s=40, marker="s", zorder=3)
        ax.annotate(model, (cost * per_k, accuracy), textcoords="offset points", xytext=(5, -12), fontsize=8)
    ax.set_xlabel("cost, $ per 1,000 requests (price sheet)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
