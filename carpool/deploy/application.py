"""The Ray Serve application: `build_app(args)` -> the ingress deployment bound to its engine replicas."""

from ray import serve

from carpool.server.replicas.replica import replica_deployment

DEFAULTS = {"replicas": 2, "num_threads": 1}


def serve_flags(args: dict) -> list[str]:
    """`carpool serve`'s command line for a config file's `args` ({"num_threads": 1, "model": [..], "no_warmup":
    true}); ValueError naming the argument for a value of a kind no flag takes."""
    flags = []
    for name, value in {**DEFAULTS, **args}.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for item in value:
                flags += [flag, str(item)]
        elif isinstance(value, (str, int, float)):
            flags += [flag, str(value)]
        else:
            raise ValueError(f"{name}: expected a string, number, boolean or list, got {type(value).__name__}")
    return flags


def parse_serve_flags(flags: list[str]):
    """(args, {served name: EngineConfig}) as `carpool serve` would parse them."""
    from carpool.cli import build_parser
    from carpool.server.assembly import model_configs

    args = build_parser().parse_args(["serve", *flags])
    return args, model_configs(args)


# No CPU reserved: its work is HTTP, tokenizing and bookkeeping; the replicas hold the CPUs (a config file can
# give it some: `deployments: [{name: Ingress, ray_actor_options: {num_cpus: 2}}]`).
@serve.deployment(
    max_ongoing_requests=4096,
    ray_actor_options={"num_cpus": 0},
    logging_config={"log_level": "WARNING", "enable_access_log": False},
)
@serve.ingress()
class Ingress:
    """The carpool app (carpool.server.app) over ReplicaRouters to this application's engine replicas."""

    async def __init__(self, flags: list[str], replicas: dict[str, list]):
        from carpool.engine.door import RequestDoor
        from carpool.server.assembly import build_app, open_stores
        from carpool.server.replicas.router import ReplicaRouter
        from carpool.server.replicas.routing import make_routing
        from carpool.server.replicas.serve import wire_metrics

        args, configs = parse_serve_flags(flags)
        self._stores = open_stores(args, configs)
        routers = {}
        for name, config in configs.items():
            handles = replicas[name]
            limits = await handles[0].limits.remote()
            routers[name] = ReplicaRouter(
                name,
                handles,
                RequestDoor.for_model_files(
                    config.model, limits["max_model_len"], limits["max_request_tokens"], config.cache_min_tokens
                ),
                config,
                make_routing(args.routing, limits["block_size"]),
                limits["max_num_seqs"],
            )
        self._asgi = build_app(args, configs, routers, self._stores)
        wire_metrics(self._asgi, routers)

    def __serve_build_asgi_app__(self):
        return self._asgi  # not `self.app`: Serve's ASGI wrapper owns that name


def build_app(args: dict):
    """The application for `serve run` (an application builder: Serve passes the config file's `args`)."""
    from carpool.server.assembly import checked_extensions

    flags = serve_flags(args)
    parsed, configs = parse_serve_flags(flags)
    if parsed.replicas < 1:
        raise ValueError(f"replicas: must be at least 1, got {parsed.replicas}")
    checked_extensions(parsed, configs)  # a bad --cascades file or --compression-model fails before any deploy
    replicas = {
        name: [replica_deployment(config, name, i, warmup=not parsed.no_warmup) for i in range(parsed.replicas)]
        for name, config in configs.items()
    }
    return Ingress.bind(flags, replicas)
