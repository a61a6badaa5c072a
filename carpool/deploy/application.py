"""The Ray Serve application: `build_app(args)` -> the ingress deployment bound to its engine replicas."""

from ray import serve

from carpool.server.replicas.serve import replica_deployments

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
    """The carpool app (carpool.server.app) over a router to each model's engine replicas (serve.make_router)."""

    async def __init__(self, flags: list[str], replicas: dict[str, list]):
        from carpool.server.assembly import build_app, open_stores
        from carpool.server.replicas.serve import make_router, wire_metrics

        args, configs = parse_serve_flags(flags)
        self._stores = open_stores(args, configs)
        routers = {}
        for name, config in configs.items():
            handles = replicas[name]
            routers[name] = make_router(name, config, handles, await handles[0].limits.remote(), args)
        self._asgi = build_app(args, configs, routers, self._stores)
        wire_metrics(self._asgi, routers)

    def __serve_build_asgi_app__(self):
        return self._asgi  # not `self.app`: Serve's ASGI wrapper owns that name


def build_app(args: dict):
    """The application for `serve run` (an application builder: Serve passes the config file's `args`)."""
    from carpool.server.assembly import checked_extensions

    flags = serve_flags(args)
    parsed, configs = parse_serve_flags(flags)
    checked_extensions(parsed, configs)  # a bad --cascades file or --compression-model fails before any deploy
    return Ingress.bind(flags, replica_deployments(configs, parsed))
