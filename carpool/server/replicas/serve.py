"""`carpool serve --replicas N`: the ingress in this process (uvicorn, the gate, the Batch API), N engine replicas
per model on Ray Serve (a local Ray unless --ray-address), one Serve application per replica."""

import argparse
import os
import sys

from carpool.engine.config import EngineConfig

SCALE_HINT = "run `make scale` (pip install -r requirements-scale.txt)"


def import_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError(f"--replicas: needs Ray Serve, which is not installed; {SCALE_HINT}") from None
    return ray, serve


def start_ray(address: str | None, cpus_needed: int) -> None:
    """Joins the cluster at `address`, or starts a local Ray with room for every replica's threads (on a small
    machine they oversubscribe it, as the user asked)."""
    ray, serve = import_ray()
    if address:
        ray.init(address=address, namespace="carpool", logging_level="warning")
    else:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, cpus_needed),
            include_dashboard=False,
            namespace="carpool",
            logging_level="warning",
        )
    serve.start(proxy_location="Disabled")  # HTTP is the ingress's own (this process, or carpool.deploy's)


def deploy_routers(configs: dict[str, EngineConfig], replicas: int, routing: str, warmup: bool) -> dict:
    """{served name: ReplicaRouter} once every replica has loaded its model (all load at once)."""
    from ray import serve

    from carpool.engine.door import RequestDoor
    from carpool.server.replicas.replica import replica_deployment
    from carpool.server.replicas.router import ReplicaRouter
    from carpool.server.replicas.routing import make_routing

    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    targets = {
        name: [
            serve.RunTarget(replica_deployment(config, name, i, warmup), name=app_name(name, i), route_prefix=None)
            for i in range(replicas)
        ]
        for name, config in configs.items()
    }
    handles = serve.run_many([target for group in targets.values() for target in group])
    routers, start = {}, 0
    for name, config in configs.items():
        mine, start = handles[start : start + replicas], start + replicas
        limits = mine[0].limits.remote().result()
        routers[name] = ReplicaRouter(
            name,
            mine,
            RequestDoor.for_model_files(
                config.model, limits["max_model_len"], limits["max_request_tokens"], config.cache_min_tokens
            ),
            config,
            make_routing(routing, limits["block_size"]),
            limits["max_num_seqs"],
        )
    return routers


def app_name(model_name: str, index: int) -> str:
    return f"engine-{model_name.replace('/', '_')}-{index}"


def wire_metrics(app, routers: dict) -> None:
    """/metrics with the replicas' series labelled, and the router's own (requests routed, replicas up)."""
    from carpool.server.replicas.metrics import merge_replica_metrics, register_router_metrics

    metrics = app.state.metrics
    routed, up = register_router_metrics(metrics.registry)
    for router in routers.values():
        router.register_metrics(routed, up)

    def render(registry):
        texts = {}
        for name, router in routers.items():
            prefix = "" if len(routers) == 1 else f"{name}/"
            texts.update({prefix + replica: text for replica, text in router.metrics_texts().items()})
        return merge_replica_metrics(registry, texts)

    metrics.render_replicas = render


def serve_replicas(args: argparse.Namespace, configs: dict[str, EngineConfig]) -> int:
    """Each step of a cascade is an ordinary request, routed to its model's replicas like any other."""
    import_ray()
    import ray
    import uvicorn
    from ray import serve

    from carpool.server.assembly import build_app, open_stores

    stores = open_stores(args, configs)
    threads = max(config.num_threads or 1 for config in configs.values())
    try:
        start_ray(args.ray_address, args.replicas * threads * len(configs))
        routers = deploy_routers(configs, args.replicas, args.routing, warmup=not args.no_warmup)
        app = build_app(args, configs, routers, stores)
        wire_metrics(app, routers)
        sys.setswitchinterval(0.001)  # as in `carpool serve`: the event loop is this process's hot thread
        server = uvicorn.Server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
        )
        server.run()  # on this thread: uvicorn handles SIGINT/SIGTERM gracefully
        return 0 if server.started else 1
    finally:
        if ray.is_initialized():
            if args.ray_address:  # a shared cluster: take our replicas down; a local Ray goes down whole
                for name in configs:
                    for index in range(args.replicas):
                        serve.delete(app_name(name, index), _blocking=False)
            ray.shutdown()
        stores.close()
