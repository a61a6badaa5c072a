"""carpool.deploy: a config file's `args` become `carpool serve`'s own flags, checked by its own parser."""

import pathlib

import pytest

pytest.importorskip("ray.serve", reason="needs `make scale`")
from carpool.deploy.application import parse_serve_flags, serve_flags
from carpool.server.replicas.counts import ReplicaCount


def test_config_args_become_serve_flags():
    flags = serve_flags(
        {"num_threads": 2, "model": ["smollm2-135m"], "no_warmup": True, "db": None, "routing": "round-robin"}
    )
    args, configs = parse_serve_flags(flags)
    assert (args.replicas, args.routing, args.no_warmup) == (ReplicaCount(2, 2), "round-robin", True)
    assert [config.num_threads for config in configs.values()] == [2]


def test_a_bad_config_arg_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="model"):
        serve_flags({"model": {"name": "x"}})
    with pytest.raises(SystemExit):  # argparse names the flag on stderr, as `carpool serve` does
        parse_serve_flags(serve_flags({"routing": "random"}))


def test_the_deployment_checks_cascades_and_the_compression_model(tmp_path):
    from carpool.deploy.application import build_app

    args = {"model": ["smollm2-135m"], "no_warmup": True}
    served = next(iter(parse_serve_flags(serve_flags(args))[1]))
    path = tmp_path / "cascades.toml"
    for model, refused in ((served, False), ("nope", True)):
        path.write_text(
            f'[[cascade]]\nname = "c"\n[[cascade.step]]\nmodel = "{model}"\nscorer = "mean"\n'
            f'threshold = -1.0\n[[cascade.step]]\nmodel = "{served}"\n'
        )
        if refused:
            with pytest.raises(ValueError, match="model: 'nope' is not served"):
                build_app(args | {"cascades": str(path)})
        else:
            build_app(args | {"cascades": str(path)})  # cascades are served by replicas too
    with pytest.raises(ValueError, match="--compression-model: 'nope' is not served"):
        build_app(args | {"compression_model": "nope"})


def test_serve_replicas_hands_the_compression_model_and_the_cascades_to_the_app(tmp_path, monkeypatch):
    import carpool.server.app
    from carpool.server.replicas import serve

    class Built(Exception):
        pass

    def create_app(*args, **kwargs):
        raise Built(kwargs.get("compression_model"), kwargs.get("cascades"))

    monkeypatch.setattr(serve, "import_ray", lambda: None)
    monkeypatch.setattr(serve, "start_ray", lambda *args: None)
    monkeypatch.setattr(serve, "deploy_routers", lambda *args, **kwargs: {})
    monkeypatch.setattr(carpool.server.app, "create_app", create_app)
    args, configs = parse_serve_flags(serve_flags({"model": ["smollm2-135m"], "db": str(tmp_path / "l.db")}))
    served = next(iter(configs))
    args.compression_model = served
    args.cascades = str(tmp_path / "cascades.toml")
    pathlib.Path(args.cascades).write_text(
        f'[[cascade]]\nname = "c"\n[[cascade.step]]\nmodel = "{served}"\nscorer = "mean"\n'
        f'threshold = -1.0\n[[cascade.step]]\nmodel = "{served}"\n'
    )
    with pytest.raises(Built) as built:
        serve.serve_replicas(args, configs)
    compression_model, cascades = built.value.args
    assert compression_model == served and list(cascades) == ["c"]


def autoscaled_engine(args: dict):
    """The name served and the engine deployment `build_app(args)` binds to the ingress."""
    from carpool.deploy.application import build_app

    ingress = build_app({"model": ["smollm2-135m"], "no_warmup": True, **args})._bound_deployment
    ((name, (engine,)),) = ingress.init_args[1].items()  # {served name: [its replica deployments]}
    return name, engine._bound_deployment


def test_replicas_min_max_in_the_config_file_deploys_one_autoscaled_deployment_per_model(tmp_path):
    from carpool.deploy.application import build_app

    name, engine = autoscaled_engine({"replicas": "1:3"})
    scaling = engine._deployment_config.autoscaling_config
    assert engine.name == f"engine-{name}" and (scaling.min_replicas, scaling.max_replicas) == (1, 3)
    assert scaling.policy.policy_function == "carpool.server.replicas.autoscaling:policy"
    assert engine._deployment_config.graceful_shutdown_timeout_s >= 600  # the drain: streams finish first
    with pytest.raises(SystemExit):  # argparse names --replicas on stderr
        build_app({"replicas": "3:1"})
    plan = tmp_path / "plan.json"
    plan.write_text('{"minutes": [{"at": 0, "replicas": 2}], "replica_start_seconds": 45}')
    config = autoscaled_engine({"replicas": "1:3", "capacity_plan": str(plan)})[1]._deployment_config
    policy = config.autoscaling_config.policy
    assert policy.policy_function.endswith(":PlannedPolicy") and policy.policy_kwargs == {"plan": str(plan)}
