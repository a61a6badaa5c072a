"""A bad [[router]] table is one clear line naming the router and the field; `carpool serve` refuses a router of a
model it does not serve (or one never calibrated) before any model loads; a good file round-trips."""

import pytest

from carpool.cli import main
from carpool.server.cascade.config import dump_cascades, load_cascades
from carpool.server.cascade.router import FEATURE_COUNT, Router, feature_count
from tests.server.test_cascade_config import load

CASCADE = '[[cascade]]\nname = "c"\n[[cascade.step]]\nmodel = "small"\nscorer = "mean"\nthreshold = -1.5\n'
CASCADE += '[[cascade.step]]\nmodel = "big"\n'
WEIGHTS = "[[" + ", ".join(["0.25"] * FEATURE_COUNT) + "]]"
GOOD = (
    CASCADE + f'[[router]]\nname = "r"\nmodels = ["small", "big"]\nthresholds = [0.6]\nweights = {WEIGHTS}\n'
    'bias = [-0.5]\ncascade = "c"\n'
)


def test_a_good_file_round_trips(tmp_path):
    loaded = load(tmp_path, GOOD)
    router = loaded["r"]
    assert isinstance(router, Router) and router.models == ("small", "big") and router.cascade == "c"
    assert router.thresholds == (0.6,) and len(router.weights[0]) == FEATURE_COUNT and router.bias == (-0.5,)
    assert load(tmp_path, dump_cascades(loaded)) == loaded


def test_a_file_of_routers_alone_is_enough(tmp_path):
    text = GOOD.replace(CASCADE, "").replace('cascade = "c"\n', "")
    assert list(load(tmp_path, text)) == ["r"]


@pytest.mark.parametrize(
    "change,message",
    [
        (('models = ["small", "big"]', 'models = ["small"]'), r"router\[0\] \('r'\)\.models: a router needs a list"),
        (('models = ["small", "big"]', 'models = ["small", "huge"]'), r"\.models: 'huge' is not served"),
        (("thresholds = [0.6]", "thresholds = [0.6, 0.7]"), r"\.thresholds: one per model but the last \(1\)"),
        (("thresholds = [0.6]", 'thresholds = ["high"]'), r"\.thresholds: must be a list of finite numbers"),
        ((f"weights = {WEIGHTS}", "weights = [[1.0, 2.0]]"), rf"\.weights: each list needs {FEATURE_COUNT} numbers"),
        ((f"weights = {WEIGHTS}\nbias = [-0.5]\n", ""), r"\.weights: not calibrated; `carpool cascade calibrate` fits"),
        ((f"weights = {WEIGHTS}\n", ""), r"\.bias: given without weights"),
        (("bias = [-0.5]", "bias = [-0.5, 1.0]"), r"\.bias: one per model but the last \(1\), got 2"),
        (('cascade = "c"', 'cascade = "nope"'), r"\.cascade: 'nope' is not a cascade of this file"),
        (('cascade = "c"', 'cascade = "c"\ncolour = 1'), r"router\[0\] \('r'\)\.colour: unknown field"),
        (('name = "r"', 'name = "c"'), r"router\[0\] \('c'\)\.name: 'c' is already a cascade's name"),
        (('name = "r"', 'name = "big"'), r"\('big'\)\.name: 'big' is already a served model's name"),
    ],
)
def test_a_bad_router_names_the_field(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        load(tmp_path, GOOD.replace(*change))


def test_a_router_cascade_must_have_its_models(tmp_path):
    text = GOOD.replace('models = ["small", "big"]', 'models = ["big", "small"]')
    with pytest.raises(ValueError, match=r"\.cascade: 'c' has models \['small', 'big'\], not \['big', 'small'\]"):
        load(tmp_path, text)


def test_serve_refuses_a_router_of_an_unserved_model_in_one_line(tmp_path, capsys):
    path = tmp_path / "cascades.toml"
    path.write_text(GOOD.replace(CASCADE, "").replace('cascade = "c"\n', ""))
    assert main(["serve", "--cascades", str(path), "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "router[0] ('r').models: 'small' is not served" in err and len(err.splitlines()) == 1


def test_the_shipped_support_mix_file_serves():
    """docs/cascades/support-mix.toml, as `carpool cascade calibrate` wrote it for the journal's fold 1."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "cascades" / "support-mix.toml"
    served = load_cascades(path, ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    assert served["support-router-cascade"].cascade == "support"
    question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    assert served["support-router"].route(question) == 1


def test_an_unknown_feature_set_is_one_line_naming_the_field(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"router\[0\] \('r'\)\.features: must be one of 'words', 'prompt-pass'"):
        load(tmp_path, GOOD + 'features = "tokens"\n')
    path = tmp_path / "cascades.toml"
    path.write_text(GOOD.replace(CASCADE, "").replace('cascade = "c"\n', "") + 'features = "tokens"\n')
    assert main(["serve", "--cascades", str(path), "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "('r').features: must be one of 'words', 'prompt-pass', got 'tokens'" in err
    assert len(err.splitlines()) == 1


def test_prompt_pass_weights_count_the_pass_statistics(tmp_path):
    text = GOOD + 'features = "prompt-pass"\n'
    with pytest.raises(ValueError, match=rf"\.weights: each list needs {feature_count('prompt-pass')} numbers"):
        load(tmp_path, text)
    longer = "[[" + ", ".join(["0.25"] * feature_count("prompt-pass")) + "]]"
    loaded = load(tmp_path, text.replace(WEIGHTS, longer))
    assert loaded["r"].features == "prompt-pass" and load(tmp_path, dump_cascades(loaded)) == loaded
