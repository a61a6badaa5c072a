"""Scale-out: one OpenAI-compatible ingress in front of N engine replicas on Ray Serve (`carpool serve --replicas N`,
or `serve run` with carpool/deploy/serve.yaml).

The ingress is the ordinary carpool app (create_app): tiers, the gate and its ledger, budgets, the Batch API and
/metrics all run there, unchanged, because the app's engine is a `ReplicaRouter`, which offers the app the same
interface an AsyncEngine does and forwards each request to one replica's engine (a Ray Serve deployment each, so
Ray restarts the one that dies). Which replica: `routing` (prefix-cache affinity by default).
"""
