"""lb's Prometheus figures, read from the replica's services table at each
scrape (no etcd read): services by type and their backends by state (no
service names as labels)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.common.sync import Table
from flagella.lb.model import BackendState, ServiceRecord, ServiceType


class LbCollector(Collector):
    def __init__(self, services: Table[int, ServiceRecord]) -> None:
        self.services = services

    def collect(self) -> Iterator[Metric]:
        types: Counter[ServiceType] = Counter()
        states: Counter[BackendState] = Counter()
        for record in self.services.values():
            types[record.type] += 1
            states.update(b.state for b in record.backends)
        services = GaugeMetricFamily(
            "flagella_services", "Load-balanced services, by type.", labels=("type",)
        )
        for kind in ServiceType:
            services.add_metric((kind.value,), types.get(kind, 0))
        backends = GaugeMetricFamily(
            "flagella_service_backends",
            "Backends of every service (one per service it serves), by state.",
            labels=("state",),
        )
        for state in BackendState:
            backends.add_metric((state.value,), states.get(state, 0))
        yield services
        yield backends
