"""ipam's Prometheus figures, read from the pool cache at each scrape (no
etcd read): each node's pod addresses, capacity and used, per family (as
Cilium's cilium_ipam_capacity and cilium_ip_addresses; the node label is
bounded by the cluster's nodes), and allocations and releases by outcome."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.common.metrics import outcome_family
from flagella.ipam.service import IpamService

POOL = ("family", "node")


class IpamCollector(Collector):
    def __init__(self, service: IpamService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        capacity, used = (
            GaugeMetricFamily(name, f"Pod addresses {what}, by family and node.", labels=POOL)
            for name, what in (
                ("flagella_ipam_capacity", "a node's CIDR holds"),
                ("flagella_ipam_addresses", "allocated or reserved on a node"),
            )
        )
        for node, entry in sorted(self.service.cache.nodes.items()):
            for family, pool in sorted(entry.pools.items()):
                labels = (family.label, node)
                capacity.add_metric(labels, pool.capacity)
                used.add_metric(labels, len(pool.used))
        yield capacity
        yield used
        yield outcome_family(
            "flagella_ipam_operations",
            "Address allocations and releases, by operation and outcome.",
            ("operation", "outcome"),
            self.service.outcomes,
        )
