"""The cost-vs-accuracy curve of a cascade's thresholds, with each single model as a point."""

from pathlib import Path

from carpool.server.cascade.calibrate import Outcome


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
    outcomes: list[Outcome],
    singles: dict[str, tuple[float, float]],
    chosen: Outcome | None,
    metric: str = "accuracy",
) -> None:
    """`singles`: {model: (mean cost, accuracy)}. Costs are drawn in dollars per 1,000 requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_k = 1000.0
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    ax.scatter(
        [o.cost * per_k for o in outcomes],
        [o.accuracy for o in outcomes],
        s=6,
        color="0.75",
        label="cascade, each threshold",
    )
    edge = frontier(outcomes)
    ax.plot([o.cost * per_k for o in edge], [o.accuracy for o in edge], color="tab:blue", label="cascade frontier")
    for model, (cost, accuracy) in singles.items():
        ax.scatter([cost * per_k], [accuracy], s=40, marker="s", zorder=3)
        ax.annotate(model, (cost * per_k, accuracy), textcoords="offset points", xytext=(5, -12), fontsize=8)
    if chosen is not None:
        ax.scatter(
            [chosen.cost * per_k],
            [chosen.accuracy],
            s=120,
            marker="*",
            color="tab:red",
            zorder=4,
            label="calibrated thresholds",
        )
    ax.set_xlabel("cost, $ per 1,000 requests (price sheet)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
