"""policy's Prometheus figures, read from the replica's mirror at each
scrape (no etcd read), as Cilium's: identities by type (cilium_identity),
rules by source (cilium_policy), the policy revision
(cilium_policy_max_revision), and rule changes by outcome
(cilium_policy_change_total)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
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
        yield identities
        yield rules
        yield revision
        yield outcome_family(
            "flagella_policy_change",
            "Rule changes (API imports and deletions, Kubernetes objects), by outcome.",
            ("outcome",),
            self.service.rules.changes,
        )
