"""Calibration: the cheapest thresholds that meet a target, checked against a brute force over every threshold a
scored set allows; the command end to end from cached runs (no model runs): TOML written, curve drawn."""

import itertools
import json
import math
import random
from dataclasses import asdict

import pytest

from carpool.cli import main
from carpool.server.cascade import calibrate
from carpool.server.cascade.config import load_cascades
from carpool.server.cascade.runs import Attempt, final_number, same_answer
from carpool.server.cascade.scorers import Scorer, features, fit_logistic


def synthetic_table(steps: int, size: int, seed: int) -> calibrate.Table:
    """Costs grow by step; a step is right more often when its score is high."""
    rng = random.Random(seed)
    scores = [[round(rng.uniform(-3, 0), 2) for _ in range(size)] for _ in range(steps)]
    right = [[rng.random() < 0.3 + 0.2 * s + 0.15 * (score + 3) / 3 for score in scores[s]] for s in range(steps)]
    costs = [[(s + 1) ** 2 * rng.uniform(0.8, 1.2) for _ in range(size)] for s in range(steps)]
    return calibrate.Table(scores, costs, right)


def brute_force(data: calibrate.Table, target: float) -> tuple[float, float]:
    """(cost, accuracy) of the cheapest way through the cascade meeting the target, every threshold tried."""
    best = None
    grids = [sorted(set(scores)) + [math.inf] for scores in data.scores[:-1]]
    for thresholds in itertools.product(*grids):
        cost = right = 0
        for i in range(data.size):
            for s in range(len(data.costs)):
                cost += data.costs[s][i]
                if s == len(data.costs) - 1 or data.scores[s][i] >= thresholds[s]:
                    right += data.right[s][i]
                    break
        if right / data.size >= target and (best is None or (cost, -right) < best):
            best = (cost, -right)
    return best[0] / data.size, -best[1] / data.size


@pytest.mark.parametrize("steps,seed", [(2, 1), (2, 2), (3, 3)])
def test_picks_the_cheapest_thresholds_meeting_the_target(steps, seed):
    data = synthetic_table(steps, 24, seed)
    target = sum(data.right[-1]) / data.size  # as accurate as the last model alone
    chosen = calibrate.cheapest_meeting(calibrate.sweep(data), target)
    cost, accuracy = brute_force(data, target)
    assert chosen.accuracy >= target
    assert chosen.cost == pytest.approx(cost) and chosen.accuracy == pytest.approx(accuracy)
    assert calibrate.replay(data, chosen.thresholds) == chosen


def test_an_unreachable_target_is_a_clear_error():
    data = synthetic_table(2, 10, 4)
    with pytest.raises(ValueError, match="target: 1.010 is above the best"):
        calibrate.cheapest_meeting(calibrate.sweep(data), 1.01)


def test_logistic_scorer_ranks_right_answers_above_wrong_ones():
    rng = random.Random(5)
    rows, labels = [], []
    for _ in range(200):
        right = rng.random() < 0.5
        logprobs = [rng.gauss(-0.2 if right else -1.0, 0.3) for _ in range(rng.randint(5, 40))]
        rows.append(features(logprobs, False))
        labels.append(right)
    weights, bias = fit_logistic(rows, labels)
    scorer = Scorer("logistic", weights=weights, bias=bias)
    probabilities = [1 / (1 + math.exp(-(sum(w * f for w, f in zip(weights, row)) + bias))) for row in rows]
    right_mean = sum(p for p, label in zip(probabilities, labels) if label) / sum(labels)
    wrong_mean = sum(p for p, label in zip(probabilities, labels) if not label) / (len(labels) - sum(labels))
    assert right_mean > 0.8 and wrong_mean < 0.2
    assert scorer.score([-0.1] * 10) > 0.5 > scorer.score([-1.5] * 10)


def test_answers_compare_by_their_final_number():
    assert final_number("She pays $1,250.00 in total.\nThe answer is 1,250.") == "1250"
    assert final_number("Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18") == "18"
    assert same_answer("so 3 + 4 = 7. The answer is 7", "3+4\n#### 7")
    assert not same_answer("The answer is 8", "#### 7") and not same_answer("no idea", "#### 7")


def write_runs(runs, model, prompts, max_tokens, answers):
    """A --runs cache file for `model`, as `carpool cascade calibrate` writes it."""
    lines = [json.dumps({"max_tokens": max_tokens, "prompts": prompts})]
    for text, logprobs in answers:
        lines.append(
            json.dumps(
                asdict(
                    Attempt(
                        text, logprobs, 20, len(logprobs), "stop", 0.001 * len(logprobs) * (3 if "big" in model else 1)
                    )
                )
            )
        )
    (runs / f"{model}.jsonl").write_text("\n".join(lines) + "\n")


def test_calibrate_command_writes_thresholds_and_draws_the_curve(tmp_path, capsys):
    questions = [f"What is {i} + 1?" for i in range(8)]
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": f"#### {i + 1}"}) + "\n" for i, q in enumerate(questions))
    )
    runs = tmp_path / "runs"
    runs.mkdir()
    # The small model is right on even questions, and sure of itself (mean logprob -0.1) only there.
    small = [(f"The answer is {i + 1 if i % 2 == 0 else 0}", [-0.1 if i % 2 == 0 else -2.0] * 4) for i in range(8)]
    write_runs(runs, "small", questions, 64, small)
    write_runs(runs, "big", questions, 64, [(f"The answer is {i + 1}", [-0.05] * 4) for i in range(8)])
    toml = tmp_path / "cascades.toml"
    toml.write_text(
        '[[cascade]]\nname = "c"\n[[cascade.step]]\nmodel = "small"\nscorer = "mean"\nthreshold = 0.0\n'
        '[[cascade.step]]\nmodel = "big"\n'
    )
    plot = tmp_path / "curve.png"
    args = [
        "--cascades",
        str(toml),
        "--cascade",
        "c",
        "--data",
        str(tmp_path / "data.jsonl"),
        "--runs",
        str(runs),
        "--max-tokens",
        "64",
        "--plot",
        str(plot),
    ]
    assert main(["cascade", "calibrate", *args, "--target-accuracy", "1.0"]) == 0
    assert "thresholds written to" in capsys.readouterr().out
    step = load_cascades(toml)["c"].steps[0]
    assert -2.0 < step.threshold <= -0.1  # accepts exactly the sure (and right) answers
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["cascade", "evaluate", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cascade"]["accuracy"] == 1.0 and report["cascade"]["shares"] == [0.5, 0.5]
    assert report["cascade"]["cost"] < report["singles"]["big"][0]


def test_cached_runs_run_only_the_prompts_not_yet_answered(tmp_path, monkeypatch):
    from carpool.server.cascade import runs

    asked = []

    def fake_run(model, examples, max_tokens, cost, num_threads=None):
        asked.append([(e.prompt, e.max_tokens or max_tokens) for e in examples])
        return [Attempt(f"answer to {e.prompt}", [-0.1], 3, 1, "stop", 0.001) for e in examples]

    monkeypatch.setattr(runs, "run_model", fake_run)
    first = [runs.Example("a"), runs.Example("b", max_tokens=8)]
    runs.cached_runs(tmp_path, "m", first, 64, None)
    again = runs.cached_runs(tmp_path, "m", [runs.Example("b", max_tokens=8), runs.Example("c")], 64, None)
    assert asked == [[("a", 64), ("b", 8)], [("c", 64)]]
    assert [a.text for a in again] == ["answer to b", "answer to c"]
    runs.cached_runs(tmp_path, "m", [runs.Example("b", max_tokens=16)], 64, None)  # another limit: another answer
    assert asked[-1] == [("b", 16)]
