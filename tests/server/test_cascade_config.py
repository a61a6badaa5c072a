"""A bad cascades TOML is a ValueError naming the cascade and the field; `carpool serve` refuses it before any
model loads, and refuses a step naming a model it does not serve."""

import pytest

from carpool.cli import main
from carpool.server.cascade.config import dump_cascades, load_cascades

SERVED = ["small", "big"]
GOOD = (
    '[[cascade]]\nname = "c"\n[[cascade.step]]\nmodel = "small"\nscorer = "tail"\nthreshold = -1.5\n'
    'tail_tokens = 4\n[[cascade.step]]\nmodel = "big"\n'
)


def load(tmp_path, text, served=SERVED):
    path = tmp_path / "cascades.toml"
    path.write_text(text)
    return load_cascades(path, served)


def test_a_good_file_round_trips(tmp_path):
    cascades = load(tmp_path, GOOD)
    step = cascades["c"].steps[0]
    assert cascades["c"].models == SERVED and step.threshold == -1.5 and step.scorer.tail_tokens == 4
    assert load(tmp_path, dump_cascades(cascades)) == cascades


@pytest.mark.parametrize(
    "change,message",
    [
        (("threshold = -1.5", 'threshold = "high"'), r"cascade\[0\] \('c'\)\.step\[0\]\.threshold: must be a finite"),
        (('scorer = "tail"', 'scorer = "vibes"'), r"step\[0\]\.scorer: must be one of mean, min, tail, logistic"),
        (('scorer = "tail"', 'scorer = "logistic"'), r"step\[0\]\.weights: the logistic scorer needs 5 weights"),
        (("tail_tokens = 4", "tail_tokens = 0"), r"step\[0\]\.tail_tokens: must be a positive integer"),
        (("tail_tokens = 4", "treshold = 1"), r"step\[0\]\.treshold: unknown field"),
        (('model = "big"', 'model = "big"\nscorer = "mean"'), r"step\[1\]\.scorer: the last step answers whatever"),
        (('model = "big"', 'model = "huge"'), r"step\[1\]\.model: 'huge' is not served \(served: small, big\)"),
        (('name = "c"', 'name = "big"'), r"cascade\[0\] \('big'\)\.name: 'big' is already a served model's name"),
        (('[[cascade.step]]\nmodel = "big"\n', ""), r"\.step: a cascade needs at least two"),
        (('name = "c"', 'name = "c'), r"not valid TOML"),
    ],
)
def test_a_bad_file_names_the_field(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        load(tmp_path, GOOD.replace(*change))


def test_serve_refuses_a_cascade_of_an_unserved_model_before_loading(tmp_path, capsys):
    path = tmp_path / "cascades.toml"
    path.write_text(GOOD)
    assert main(["serve", "--cascades", str(path), "--port", "1"]) == 2
    assert "step[0].model: 'small' is not served" in capsys.readouterr().err
