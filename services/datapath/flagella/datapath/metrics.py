"""The datapath's Prometheus figures, read at each scrape: packets and bytes
dropped (by reason and direction) and forwarded (by direction) from the BPF
metrics map, as Cilium's cilium_drop_count_total and friends; flow events
lost; endpoints on the node."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.datapath.bpf import layout as L
from flagella.datapath.service import DatapathService


def reason_name(reason: int) -> str:
    try:
        return L.DropReason(reason).name
    except ValueError:
        return f"REASON_{reason}"


class DatapathCollector(Collector):
    def __init__(self, service: DatapathService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        drops = CounterMetricFamily(
            "flagella_drop_count",
            "Packets dropped by the BPF datapath, by drop reason and direction.",
            labels=("reason", "direction"),
        )
        drop_bytes = CounterMetricFamily(
            "flagella_drop_bytes",
            "Bytes dropped by the BPF datapath, by drop reason and direction.",
            labels=("reason", "direction"),
        )
        forwards = CounterMetricFamily(
            "flagella_forward_count",
            "Packets the BPF datapath passed on, by direction.",
            labels=("direction",),
        )
        forward_bytes = CounterMetricFamily(
            "flagella_forward_bytes",
            "Bytes the BPF datapath passed on, by direction.",
            labels=("direction",),
        )
        safety = CounterMetricFamily(
            "flagella_host_safety_count",
            "Packets of the node's own control-plane traffic the host policy's safety set "
            "let through before policy, by direction.",
            labels=("direction",),
        )
        lost = CounterMetricFamily(
            "flagella_flow_events_lost",
            "Flow events the datapath's ring buffer had no room for.",
        )
        bpf = self.service.loaded
        lost_packets = 0
        if bpf is not None:
            for c in bpf.metrics.nonzero():
                direction = c.direction.name
                if c.reason == L.REASON_FORWARDED:
                    forwards.add_metric((direction,), c.packets)
                    forward_bytes.add_metric((direction,), c.bytes)
                elif c.reason == L.REASON_HOST_SAFETY:
                    safety.add_metric((direction,), c.packets)
                elif c.reason == L.METRIC_EVENTS_LOST:
                    lost_packets += c.packets
                else:
                    drops.add_metric((reason_name(c.reason), direction), c.packets)
                    drop_bytes.add_metric((reason_name(c.reason), direction), c.bytes)
        lost.add_metric((), lost_packets)
        endpoints = GaugeMetricFamily(
            "flagella_endpoint_count", "Endpoints (pods) the datapath serves on this node."
        )
        endpoints.add_metric((), len(self.service.endpoints))
        yield from (drops, drop_bytes, forwards, forward_bytes, safety, lost, endpoints)
