"""carpool.deploy: a config file's `args` become `carpool serve`'s own flags, checked by its own parser."""

import pytest

pytest.importorskip("ray.serve", reason="needs `make scale`")
from carpool.deploy.application import parse_serve_flags, serve_flags  # noqa: E402


def test_config_args_become_serve_flags():
    flags = serve_flags({"num_threads": 2, "model": ["smollm2-135m"], "no_warmup": True, "db": None,
                         "routing": "round-robin"})
    args, configs = parse_serve_flags(flags)
    assert (args.replicas, args.routing, args.no_warmup) == (2, "round-robin", True)
    assert [config.num_threads for config in configs.values()] == [2]


def test_a_bad_config_arg_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="model"):
        serve_flags({"model": {"name": "x"}})
    with pytest.raises(SystemExit):  # argparse names the flag on stderr, as `carpool serve` does
        parse_serve_flags(serve_flags({"routing": "random"}))
