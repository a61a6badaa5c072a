"""Where `reproducible` resolves on and off (EngineConfig), and the ValueError that names the setting standing in
its way when it is asked for where it cannot hold."""

import pytest

from carpool.engine.config import EngineConfig
from carpool.kernels import kernel_path
from carpool.models.quantization import resolve_matmul


def test_on_by_default_on_the_cpu_with_every_row_through_the_int8_kernels():
    config = EngineConfig(device="cpu")
    assert config.reproducible is True and config.matmul == "int8-dot-all"
    assert EngineConfig(device="cpu", matmul="int8-dot-all").reproducible is True


def test_off_gives_the_fast_modes_matmul():
    config = EngineConfig(device="cpu", reproducible=False)
    assert config.matmul == resolve_matmul("auto", kernel_path())


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"device": "cuda"}, "device cuda"),
        ({"device": "cpu", "matmul": "exact"}, "matmul='exact'"),
        ({"device": "cpu", "matmul": "int8-dot"}, "matmul='int8-dot'"),
        ({"device": "cpu", "quantization": "none"}, "quantization='none'"),
    ],
)
def test_settings_whose_arithmetic_follows_the_batch_turn_it_off_and_refuse_it(setting, named):
    assert EngineConfig(**setting).reproducible is False
    with pytest.raises(ValueError, match=f"reproducible=True cannot hold with {named}"):
        EngineConfig(reproducible=True, **setting)


def test_a_dense_layer_found_at_load_turns_the_default_off_and_refuses_an_explicit_ask():
    config = EngineConfig(device="cpu")
    config.settle_reproducible("lm_head")
    assert config.reproducible is False and config.matmul == resolve_matmul("auto", kernel_path())
    asked = EngineConfig(device="cpu", reproducible=True)
    asked.settle_reproducible(None)  # every linear in a block format
    assert asked.reproducible is True
    with pytest.raises(ValueError, match=r"dense weights \(lm_head"):
        asked.settle_reproducible("lm_head")


def test_anything_but_a_bool_or_unset_is_refused():
    with pytest.raises(ValueError, match="reproducible must be true, false or unset, got 'on'"):
        EngineConfig(device="cpu", reproducible="on")
