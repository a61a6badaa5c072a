"""carpool as a Ray Serve application, for a cluster: the ingress (the OpenAI-compatible app, with its gate, tiers,
Batch API and /metrics) as one deployment behind Serve's HTTP proxy, and N engine replicas per model as their own
deployments, or one autoscaled deployment per model for `replicas: "MIN:MAX"` (`carpool serve --replicas` runs the
same pieces with the ingress in its own process).

    serve run carpool/deploy/serve.yaml            # the config file: flags, replicas, the Ray address
    serve run carpool.deploy:app                   # defaults: SmolLM2, 2 replicas x 1 thread, prefix routing
    serve run carpool.deploy:build_app replicas=4 num_threads=8 model=qwen2.5-coder-1.5b db=postgresql://...

`build_app`'s arguments are `carpool serve`'s flags by their long names (`num_threads` for --num-threads; a list
for a repeatable flag, true for a switch), checked by the same parser. Every Ray node needs carpool installed
(`make scale`) and the model files at the same path (or a catalog name it can resolve).
"""

from carpool.deploy.application import build_app

app = build_app({})

__all__ = ["app", "build_app"]
