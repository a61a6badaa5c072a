"""`carpool serve`'s per-model flags, matched to the --model flags by position; nothing here loads a model."""

import pytest

from carpool.cli import build_parser, main
from carpool.engine.config import EngineConfig
from carpool.server.assembly import default_served_name, model_configs


def configs(*argv: str) -> dict[str, EngineConfig]:
    return model_configs(build_parser().parse_args(["serve", *argv]))


def test_each_model_gets_its_name_and_budget_by_position():
    served = configs(
        "--model",
        "x.gguf",
        "--model",
        "y.gguf",
        "--served-model-name",
        "small",
        "--served-model-name",
        "large",
        "--kv-cache-gb",
        "0.25",
        "--kv-cache-gb",
        "2",
        "--max-num-seqs",
        "8",
        "--max-num-seqs",
        "16",
        "--block-size",
        "32",
    )
    assert list(served) == ["small", "large"]
    assert [(c.model, c.kv_cache_gb, c.max_num_seqs) for c in served.values()] == [
        ("x.gguf", 0.25, 8),
        ("y.gguf", 2.0, 16),
    ]
    assert {c.block_size for c in served.values()} == {32}  # a flag that is not per model applies to all


def test_one_value_applies_to_every_model_and_a_missing_one_is_the_default():
    served = configs("--model", "x.gguf", "--model", "y.gguf", "--num-kv-blocks", "64")
    assert list(served) == [default_served_name("x.gguf"), default_served_name("y.gguf")]
    assert [c.num_kv_blocks for c in served.values()] == [64, 64]
    assert {c.kv_cache_gb for c in served.values()} == {EngineConfig().kv_cache_gb}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [
                "--model",
                "x.gguf",
                "--model",
                "y.gguf",
                "--kv-cache-gb",
                "1",
                "--kv-cache-gb",
                "2",
                "--kv-cache-gb",
                "3",
            ],
            "--kv-cache-gb: 3 values for 2 models",
        ),
        (["--model", "x.gguf", "--model", "y.gguf", "--served-model-name", "one"], "--served-model-name: 1 values"),
        (["--model", "x.gguf", "--model", "x.gguf"], "two models would be served as"),
    ],
)
def test_flags_that_do_not_match_the_models_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        configs(*argv)


def test_a_price_sheet_that_prices_one_served_model_only_stops_the_server_before_it_loads(tmp_path, capsys):
    sheet = tmp_path / "prices.toml"
    sheet.write_text(
        "[cache]\nread = 0.1\nwrite = 1.25\n[tiers]\npriority = 2\ndefault = 1\nflex = 0.5\n"
        'batch = 0.5\n[models."a"]\ninput = 0.1\noutput = 0.2\n'
    )
    argv = [
        "serve",
        "--model",
        "missing.gguf",
        "--model",
        "missing.gguf",
        "--served-model-name",
        "a",
        "--served-model-name",
        "b",
        "--prices",
        str(sheet),
        "--db",
        str(tmp_path / "carpool.db"),
    ]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert str(sheet) in error and 'models."b"' in error
