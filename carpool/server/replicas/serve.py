"""`carpool serve --replicas N` (or MIN:MAX): the ingress in this process (uvicorn, the gate, the Batch API), the
engine replicas of each model on Ray Serve (a local Ray unless --ray-address): one Serve application per replica
of a fixed count, one autoscaled application per model for MIN:MAX."""

import argparse
import os
import sys

from carpool.engine.config import EngineConfig
from carpool.server.replicas.counts import ReplicaCount, capacity_plan, scale_down_delay

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


def replica_deployments(configs: dict[str, EngineConfig], args: argparse.Namespace) -> dict[str, list]:
    """{served name: its bound replica deployments}: one per replica of a fixed count, one autoscaled one for
    MIN:MAX (each named by `app_names`, in that order)."""
    from carpool.server.replicas.replica import autoscaled_deployment, replica_deployment

    count, warmup, down_delay, plan = args.replicas, not args.no_warmup, scale_down_delay(args), capacity_plan(args)
    if count.autoscaled:
        return {
            name: [autoscaled_deployment(config, name, count, warmup, down_delay, plan)]
            for name, config in configs.items()
        }
    return {
        name: [replica_deployment(config, name, i, warmup) for i in range(count.min)]
        for name, config in configs.items()
    }


def app_names(model_name: str, count: ReplicaCount) -> list[str]:
    from carpool.server.replicas.replica import app_name

    return [app_name(model_name)] if count.autoscaled else [app_name(model_name, i) for i in range(count.min)]


def make_router(name: str, config: EngineConfig, handles: list, limits: dict, args: argparse.Namespace):
    """The model's engine at the ingress, over its replicas' handles (and `limits`, any replica's answer)."""
    from carpool.engine.door import RequestDoor
    from carpool.server.replicas.autoscaled import AutoscaledRouter
    from carpool.server.replicas.board import open_board
    from carpool.server.replicas.router import ReplicaRouter
    from carpool.server.replicas.routing import make_routing

    door = RequestDoor.for_model_files(
        config.model, limits["max_model_len"], limits["max_request_tokens"], config.cache_min_tokens
    )
    slots = limits["max_num_seqs"]
    if args.replicas.autoscaled:
        return AutoscaledRouter(name, handles[0], open_board(name), door, config, args.replicas, slots)
    return ReplicaRouter(name, handles, door, config, make_routing(args.routing, limits["block_size"]), slots)


def deploy_routers(configs: dict[str, EngineConfig], args: argparse.Namespace) -> dict:
    """{served name: its router} once MIN replicas of each model have loaded and warmed up (all at once)."""
    from ray import serve

    deployments = replica_deployments(configs, args)
    apps = {name: app_names(name, args.replicas) for name in configs}
    handles = iter(
        serve.run_many(
            [
                serve.RunTarget(deployment, name=app, route_prefix=None)
                for name in configs
                for app, deployment in zip(apps[name], deployments[name], strict=True)
            ]
        )
    )
    routers = {}
    for name, config in configs.items():
        mine = [next(handles) for _ in apps[name]]
        routers[name] = make_router(name, config, mine, mine[0].limits.remote().result(), args)
    return routers


def wire_metrics(app, routers: dict) -> None:
    """/metrics with the replicas' series labelled, and the router's own (requests routed, replicas up)."""
    from carpool.server.replicas.metrics import merge_replica_metrics, register_router_metrics

    metrics = app.state.metrics
    routed, up, replicas = register_router_metrics(metrics.registry)
    for router in routers.values():
        router.register_metrics(routed, up, replicas)

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
    from carpool.server.replicas.board import open_board

    stores = open_stores(args, configs)
    threads = max(config.num_threads or 1 for config in configs.values())
    try:
        start_ray(args.ray_address, args.replicas.max * threads * len(configs))
        routers = deploy_routers(configs, args)
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
                    for app in app_names(name, args.replicas):
                        serve.delete(app, _blocking=False)
                    if args.replicas.autoscaled:
                        ray.kill(open_board(name))
            ray.shutdown()
        stores.close()
