"""/metrics of an ingress with replicas: the ingress's own series (requests, tiers, queues, the ledger) as they
are, and the series only an engine can observe (per-step batch shapes and inter-token gaps, preemptions,
speculation, KV and queue gauges) from each replica's own registry, each sample labelled `replica`."""

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# Families observed on the engine thread or read from the engine (as the text parser names them: no _total).
REPLICA_FAMILIES = frozenset(
    f"carpool:{name}"
    for name in (
        "iteration_tokens",
        "iteration_seqs",
        "inter_token_latency_seconds",
        "num_preemptions",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_accepted_length",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "cache_config_info",
        "prefix_cache_blocks",
    )
)


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_replica_metrics(registry: CollectorRegistry, replica_texts: dict[str, str]) -> bytes:
    """The ingress registry's text with every REPLICA_FAMILIES family's samples replaced by the replicas'."""
    families = {family.name: family for family in registry.collect()}
    for name in REPLICA_FAMILIES & families.keys():
        families[name].samples = []
    for replica, text in replica_texts.items():
        for family in text_string_to_metric_families(text):
            if family.name in REPLICA_FAMILIES and family.name in families:
                families[family.name].samples += [
                    Sample(s.name, {"replica": replica, **s.labels}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                ]
    return generate_latest(_Families(list(families.values())))


def register_router_metrics(registry: CollectorRegistry) -> tuple[Counter, Gauge, Gauge]:
    routed = Counter(
        "carpool:replica_requests",
        "Engine requests the router sent to each replica (a retry after a replica failed counts again).",
        ["model_name", "replica"],
        registry=registry,
    )
    up = Gauge(
        "carpool:replica_up",
        "1 while the replica answers, 0 while the router routes around it.",
        ["model_name", "replica"],
        registry=registry,
    )
    replicas = Gauge(
        "carpool:replicas",
        "Replicas of the model serving now (autoscaled: those reporting in the last 3 s; fixed: those answering).",
        ["model_name"],
        registry=registry,
    )
    return routed, up, replicas
