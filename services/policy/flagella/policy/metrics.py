"""policy's Prometheus figures, read from the replica's mirror at each
scrape (no etcd read), as Cilium's: identities by type (cilium_identity),
rules by source (cilium_policy), the policy revision
(cilium_policy_max_revision), and rule changes by outcome
(cilium_policy_change_total)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.common.metrics import outcome_family
from flagella.policy.identities import RESERVED_INFOS, Kind
from flagella.policy.service import PolicyService

#: The source of a rule put through the API (a Kubernetes rule's is its kind).
API_SOURCE = "api"


class PolicyCollector(Collector):
    def __init__(self, service: PolicyService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        state = self.service.state
        identities = GaugeMetricFamily(
            "flagella_identity",
            "Security identities this replica knows, by type.",
            labels=("type",),
        )
        for kind, count in (
            (Kind.RESERVED, len(RESERVED_INFOS)),
            (Kind.GLOBAL, len(state.identities)),
            (Kind.CIDR, len(state.cidr)),
        ):
            identities.add_metric((kind.value,), count)
        unreferenced = GaugeMetricFamily(
            "flagella_identity_unreferenced",
            "Global identities no node references: garbage the next GC rounds free.",
        )
        unreferenced.add_metric((), state.unreferenced_count())
        gc = self.service.gc
        gc_runs = CounterMetricFamily(
            "flagella_identity_gc_runs", "Identity garbage-collection rounds this replica ran."
        )
        gc_runs.add_metric((), gc.runs)
        gc_freed = CounterMetricFamily(
            "flagella_identity_gc_freed", "Identities this replica garbage-collected."
        )
        gc_freed.add_metric((), gc.freed_total)
        gc_last = GaugeMetricFamily(
            "flagella_identity_gc_last_duration_seconds",
            "How long this replica's last garbage-collection round took.",
        )
        gc_last.add_metric((), gc.last_duration)
        rules = GaugeMetricFamily(
            "flagella_policy",
            "Network policy rules in force, by source (api, or the Kubernetes kind).",
            labels=("source",),
        )
        sources = Counter(r.source.kind or API_SOURCE for r in state.rules.values())
        for source, count in sorted(sources.items()):
            rules.add_metric((source,), count)
        revision = GaugeMetricFamily(
            "flagella_policy_max_revision",
            "The etcd revision of the policy state this replica serves.",
        )
        revision.add_metric((), state.revision)
        built = CounterMetricFamily(
            "flagella_policy_watch_messages_built",
            "Watch messages this replica built, by stream: each once for every stream that"
            " sends it (a change is encoded once, not once per node).",
            labels=("stream",),
        )
        for stream, count in sorted(self.service.watch_counters.built.items()):
            built.add_metric((stream,), count)
        yield identities
        yield built
        yield unreferenced
        yield gc_runs
        yield gc_freed
        yield gc_last
        yield rules
        yield revision
        yield outcome_family(
            "flagella_policy_change",
            "Rule changes (API imports and deletions, Kubernetes objects), by outcome.",
            ("outcome",),
            self.service.rules.changes,
        )
