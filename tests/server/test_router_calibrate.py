"""`carpool cascade calibrate` fits the routers over the cascade's models from the same cached runs and writes
them; `evaluate` reports them beside the cascade. Replaying a router is exact: a routed example pays for the
routed-to model's attempt onward, never the cheaper ones before it."""

import json
import math
from dataclasses import asdict

from carpool.cli import main
from carpool.economics.prices import load_price_sheet
from carpool.server.cascade import calibrate
from carpool.server.cascade.config import load_cascades
from carpool.server.cascade.router import Router, feature_count
from carpool.server.cascade.runs import Attempt, PromptPass, reused_cost
from tests.server.test_cascade_calibrate import write_runs

WORDS = ["red", "blue", "green", "black", "white", "pink", "grey", "gold"]


def test_a_routed_example_pays_from_its_routed_to_step_on():
    data = calibrate.Table(
        scores=[[-0.1, -3.0], [math.inf, math.inf]], costs=[[1.0, 1.0], [3.0, 3.0]], right=[[True, False], [True, True]]
    )
    routed = calibrate.replay(data, (-math.inf,), starts=[0, 1])  # the router alone: the routed-to model answers
    assert (routed.cost, routed.accuracy, routed.shares) == (2.0, 1.0, (0.5, 0.5))
    both = calibrate.replay(data, (-1.0,), starts=[0, 0])  # route both to the cheap model, then escalate the unsure
    assert (both.cost, both.accuracy) == (2.5, 1.0)


def test_calibrate_fits_and_writes_the_router_and_evaluate_reports_it(tmp_path, capsys):
    plain = [f"Which colour is the sky in picture {word}?" for word in WORDS]
    numeric = [f"What is {i} + {i + 3} - 1?" for i in range(8)]
    prompts = [p for pair in zip(plain, numeric) for p in pair]
    answers = [a for pair in zip(WORDS, [f"#### {2 * i + 2}" for i in range(8)]) for a in pair]
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers))
    )
    runs = tmp_path / "runs"
    runs.mkdir()
    # The small model is right on the plain questions only, and as sure of its wrong sums as of its colours: the
    # cascade must escalate everything to be right, a router need not run the small model on a sum at all.
    small = [(a if not a.startswith("####") else "The answer is 0", [-0.1] * 4) for a in answers]
    write_runs(runs, "small", prompts, 64, small)
    write_runs(runs, "big", prompts, 64, [(a.replace("####", "The answer is"), [-0.05] * 4) for a in answers])
    toml = tmp_path / "cascades.toml"
    toml.write_text(
        '[[cascade]]\nname = "c"\n[[cascade.step]]\nmodel = "small"\nscorer = "mean"\nthreshold = 0.0\n'
        '[[cascade.step]]\nmodel = "big"\n[[router]]\nname = "r"\nmodels = ["small", "big"]\n'
    )
    args = ["--cascades", str(toml), "--cascade", "c", "--data", str(tmp_path / "data.jsonl")]
    args += ["--runs", str(runs), "--max-tokens", "64", "--plot", str(tmp_path / "curve.png")]
    assert main(["cascade", "calibrate", *args, "--target-accuracy", "1.0"]) == 0
    assert "and routers r written to" in capsys.readouterr().out
    router = load_cascades(toml)["r"]
    assert isinstance(router, Router) and router.weights is not None
    assert [router.route(p) for p in prompts] == [0, 1] * 8
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["cascade", "evaluate", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    routed = report["routers"]["router r"]
    assert routed["accuracy"] == 1.0 and routed["shares"] == [0.5, 0.5]
    assert routed["cost"] < report["cascade"]["cost"] and routed["cost"] < report["singles"]["big"][0]
    assert report["goal"]["router r"]["cost_at_equal_accuracy"] == routed["cost"] / report["singles"]["big"][0]
    assert set(report["goal"]) == {"cascade c", "router r", "router r + cascade"}


def test_a_prompt_pass_router_is_fitted_on_the_cached_passes_and_pays_for_them(tmp_path, capsys):
    """The small model's surprisal, not the words, tells its right answers (same wording, one word changed); every
    example pays its pass, and a prompt routed to the small model reads the pass's KV (runs.reused_cost)."""
    prompts = [f"Which desk takes the word {word}{i}?" for i in range(2) for word in WORDS]
    answers = [f"desk {k}" for k in range(len(prompts))]
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers))
    )
    runs = tmp_path / "runs"
    runs.mkdir()
    sure = [k % 2 == 0 for k in range(len(prompts))]  # the small model is right where the prompt surprises it little
    write_runs(runs, "small", prompts, 64, [(a if ok else "no", [-0.1] * 4) for a, ok in zip(answers, sure)])
    write_runs(runs, "big", prompts, 64, [(a, [-0.05] * 4) for a in answers])
    passes = [PromptPass([1.0 if ok else 6.0] * 19, 20, 0.0005) for ok in sure]
    lines = [json.dumps({"prompts": prompts})] + [json.dumps(asdict(p)) for p in passes]
    (runs / "small.prompt-pass.jsonl").write_text("\n".join(lines) + "\n")
    toml = tmp_path / "cascades.toml"
    toml.write_text(
        '[[cascade]]\nname = "c"\n[[cascade.step]]\nmodel = "small"\nscorer = "mean"\nthreshold = 0.0\n'
        '[[cascade.step]]\nmodel = "big"\n[[router]]\nname = "r"\nmodels = ["small", "big"]\n'
        'features = "prompt-pass"\n'
    )
    args = ["--cascades", str(toml), "--cascade", "c", "--data", str(tmp_path / "data.jsonl")]
    args += ["--runs", str(runs), "--max-tokens", "64"]
    assert main(["cascade", "calibrate", *args, "--target-accuracy", "1.0"]) == 0
    router = load_cascades(toml)["r"]
    assert router.features == "prompt-pass" and len(router.weights[0]) == feature_count("prompt-pass")
    assert [router.route(p, s.surprisals) for p, s in zip(prompts, passes)] == [0 if ok else 1 for ok in sure]
    capsys.readouterr()
    assert main(["cascade", "evaluate", *args, "--json"]) == 0
    routed = json.loads(capsys.readouterr().out)["routers"]["router r"]
    small = Attempt("", [-0.1] * 4, 20, 4, "stop", 0.004)
    expected = 0.0005 + (reused_cost("small", small, load_price_sheet(None).cost) + 0.012) / 2
    assert routed["accuracy"] == 1.0 and math.isclose(routed["cost"], expected)
