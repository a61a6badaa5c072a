"""`carpool cascade calibrate` and `carpool cascade evaluate`: run a cascade's models on a (labeled) set once,
then fit thresholds and the routers over the same models (written back to the TOML) or report accuracy and cost
of each model, of the cascade and of the routers.
Offline tools over the cascades the server runs (`carpool serve --cascades`), pricing answers with the price sheet:
like `carpool serve`'s own command line, a command line may read concrete economics."""

import argparse
import json
from dataclasses import replace
from pathlib import Path

from carpool.server.cascade.scorers import KINDS, Scorer

# Reasoning, but short: with "solve it step by step, briefly", 13 of 20 answers of the 0.5B ran past 256 tokens
# (mostly LaTeX) and a cut answer has no final number; with "write only the key calculations" it skipped the
# reasoning (9 tokens an answer) and got 1 of 20 right.
GSM8K_SUFFIX = (
    "\nThink step by step in plain text (no LaTeX), one short line per step, then end with: The answer is <number>."
)


def add_cascade_parser(subparsers) -> None:
    parser = subparsers.add_parser("cascade", help="fit and evaluate model cascades (carpool serve --cascades)")
    commands = parser.add_subparsers(dest="cascade_command", required=True)
    calibrate = commands.add_parser(
        "calibrate",
        help="fit the cheapest thresholds that meet a target, and the routers over the cascade's models; write them "
        "to the TOML",
    )
    _common_args(calibrate)
    target = calibrate.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-accuracy", type=float, help="share of answers matching the data's `answer`")
    target.add_argument(
        "--target-agreement",
        type=float,
        help="share of answers matching the last (strongest) model's: for data without answers",
    )
    calibrate.add_argument(
        "--scorer",
        choices=KINDS,
        default=None,
        help="use this scorer on every step but the last (default: each step's own in the TOML)",
    )
    calibrate.set_defaults(func=_calibrate)
    evaluate = commands.add_parser(
        "evaluate", help="accuracy and cost of each model alone, of the cascade and of the routers over its models"
    )
    _common_args(evaluate)
    evaluate.add_argument("--agreement", action="store_true", help="score against the last model's answers")
    evaluate.add_argument("--json", action="store_true", help="print the figures as JSON")
    evaluate.set_defaults(func=_evaluate)


def _common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cascades", required=True, help="the cascades TOML (as given to carpool serve)")
    parser.add_argument("--cascade", required=True, help="the cascade's name in it")
    parser.add_argument("--data", required=True, help="JSONL: `prompt` (or `question`) and `answer` per line")
    parser.add_argument("--offset", type=int, default=0, help="skip this many lines (disjoint splits)")
    parser.add_argument("--limit", type=int, default=None, help="use at most this many lines")
    parser.add_argument("--suffix", default="", help="appended to every prompt (--gsm8k sets a default)")
    parser.add_argument(
        "--gsm8k", action="store_true", help=f"append the GSM8K answer instruction to every prompt: {GSM8K_SUFFIX!r}"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per answer at most")
    parser.add_argument(
        "--runs", default=None, help="folder caching each model's answers (<model>.jsonl), reused when prompts match"
    )
    parser.add_argument("--plot", default=None, help="draw the cost-vs-accuracy curve to this PNG")
    parser.add_argument("--prices", default=None, help="price sheet TOML (default: the shipped one)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads for the models")


def _scored(args: argparse.Namespace):
    from carpool.economics.prices import load_price_sheet
    from carpool.server.cascade.config import load_cascades
    from carpool.server.cascade.router import Router
    from carpool.server.cascade.runs import cached_runs, load_examples

    cascades = load_cascades(args.cascades)
    if args.cascade not in cascades:
        raise ValueError(f"--cascade: {args.cascade!r} is not in {args.cascades} ({', '.join(cascades)})")
    if isinstance(cascades[args.cascade], Router):
        raise ValueError(f"--cascade: {args.cascade!r} is a router; name a cascade of its models (routers follow it)")
    examples = load_examples(args.data, args.offset, args.limit, args.suffix + (GSM8K_SUFFIX if args.gsm8k else ""))
    cost = load_price_sheet(args.prices).cost
    models = cascades[args.cascade].models
    attempts = [cached_runs(args.runs, model, examples, args.max_tokens, cost, args.num_threads) for model in models]
    return cascades, examples, attempts, _passes(args, cascades, examples, attempts, cost)


def _passes(args, cascades, examples, attempts, cost):
    """The cheapest model's prompt passes, when a router over the cascade's models reads them."""
    from carpool.server.cascade.calibrate import Passes
    from carpool.server.cascade.compare import routers_of
    from carpool.server.cascade.runs import cached_prompt_passes, reused_cost

    cascade = cascades[args.cascade]
    if not any(router.reads_prompt_pass for router in routers_of(cascades, cascade)):
        return None
    cheapest = cascade.models[0]
    passes = cached_prompt_passes(args.runs, cheapest, examples, cost, args.num_threads)
    return Passes(
        [p.surprisals for p in passes],
        [p.cost for p in passes],
        [reused_cost(cheapest, attempt, cost) for attempt in attempts[0]],
    )


def _singles(cascade, data) -> dict[str, tuple[float, float]]:
    return {
        model: (sum(data.costs[s]) / data.size, sum(data.right[s]) / data.size)
        for s, model in enumerate(cascade.models)
    }


def _calibrate(args: argparse.Namespace) -> int:
    from carpool.server.cascade import calibrate, compare
    from carpool.server.cascade.config import dump_cascades
    from carpool.server.cascade.plot import draw_curve

    cascades, examples, attempts, passes = _scored(args)
    cascade = cascades[args.cascade]
    if args.scorer is not None:
        steps = [
            replace(
                step,
                scorer=Scorer(args.scorer, weights=(0.0,) * 5) if args.scorer == "logistic" else Scorer(args.scorer),
            )
            for step in cascade.steps[:-1]
        ]
        cascade = replace(cascade, steps=(*steps, cascade.steps[-1]))
    agreement = args.target_agreement is not None
    target = args.target_agreement if agreement else args.target_accuracy
    right = calibrate.labels(examples, attempts, agreement)
    cascade = calibrate.fit_scorers(cascade, attempts, right)
    data = calibrate.table(cascade, attempts, right)
    outcomes = calibrate.sweep(data)
    chosen = calibrate.cheapest_meeting(outcomes, target)
    cascade = cascades[cascade.name] = calibrate.with_thresholds(cascade, chosen.thresholds)
    routers = compare.fit_routers(cascades, cascade, examples, data, target, passes)
    cascades.update(routers)
    Path(args.cascades).write_text(dump_cascades(cascades), encoding="utf-8")
    metric = "agreement with the last model" if agreement else "accuracy"
    found = compare.curves(cascades, cascade, examples, data, passes)
    if args.plot:
        draw_curve(
            args.plot, f"{cascade.name}: {data.size} examples (calibration)", found, _singles(cascade, data), metric
        )
    print(_summary(cascade, data, found, metric))
    print(f"thresholds{' and routers ' + ', '.join(routers) if routers else ''} written to {args.cascades}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from carpool.server.cascade import calibrate, compare
    from carpool.server.cascade.plot import draw_curve

    cascades, examples, attempts, passes = _scored(args)
    cascade = cascades[args.cascade]
    right = calibrate.labels(examples, attempts, args.agreement)
    data = calibrate.table(cascade, attempts, right)
    found = compare.curves(cascades, cascade, examples, data, passes)
    metric = "agreement with the last model" if args.agreement else "accuracy"
    if args.plot:
        draw_curve(
            args.plot, f"{cascade.name}: {data.size} examples (held out)", found, _singles(cascade, data), metric
        )
    if args.json:
        singles = _singles(cascade, data)
        last_cost, last_accuracy = singles[cascade.models[-1]]
        outcome = found[0].point
        report = {
            "examples": data.size,
            "singles": singles,
            "cascade": {"accuracy": outcome.accuracy, "cost": outcome.cost, "shares": outcome.shares},
            "routers": {
                curve.label: {"accuracy": curve.point.accuracy, "cost": curve.point.cost, "shares": curve.point.shares}
                for curve in found[1:]
                if curve.point is not None
            },
            "goal": {curve.label: compare.goal_points(curve, last_accuracy, last_cost) for curve in found},
        }
        print(json.dumps(report, indent=2))
    else:
        print(_summary(cascade, data, found, metric))
    return 0


def _summary(cascade, data, found, metric: str) -> str:
    """Each model alone, the cascade and the routers as configured: metric, mean cost, cost relative to the last
    model alone, share answered by each model."""
    singles = _singles(cascade, data)
    last_cost = singles[cascade.models[-1]][0]
    lines = [f"{'':42}{metric[:12]:>12}  {'$/1k req':>9}  {'vs last':>7}  answered by"]
    for model, (cost, accuracy) in singles.items():
        lines.append(f"{model + ' alone':42}{accuracy:12.1%}  {cost * 1000:9.4f}  {cost / last_cost:7.1%}")
    for curve in found:
        outcome = curve.point
        if outcome is None:
            continue
        shares = ", ".join(f"{m} {share:.0%}" for m, share in zip(cascade.models, outcome.shares))
        lines.append(
            f"{curve.label:42}{outcome.accuracy:12.1%}  {outcome.cost * 1000:9.4f}  "
            f"{outcome.cost / last_cost:7.1%}  {shares}"
        )
    thresholds = ", ".join(f"{t:.4g}" for t in found[0].point.thresholds)
    lines.append(f"cascade thresholds {thresholds} ({data.size} examples)")
    return "\n".join(lines)
