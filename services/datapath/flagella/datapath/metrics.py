"""The datapath's Prometheus figures read at each scrape: packets and bytes
dropped (by reason and direction) and forwarded (by direction) from the BPF
metrics map, as Cilium's cilium_drop_count_total and friends; flow events
lost; endpoints on the node; each map's pressure and operations by outcome
(counted by the writers and the GC: no map is walked here); the reachability
of the other nodes (the health probes' last answers). What is measured as
work happens (regeneration, policy delay, conntrack GC) is in telemetry.py."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.common.mappressure import map_pressure
from flagella.datapath.bpf import Datapath
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
        overflow = GaugeMetricFamily(
            "flagella_policy_map_overflow_endpoints",
            "Endpoints locked down (deny all) because their policy is over the policy-map budget.",
        )
        overflow.add_metric((), len(self.service.overflowing()))
        yield from (drops, drop_bytes, forwards, forward_bytes, safety, lost, endpoints, overflow)
        if bpf is not None:
            yield from map_figures(bpf)
            yield from self.prefilter_figures()
        yield from self.node_health()

    def prefilter_figures(self) -> Iterator[Metric]:
        """The XDP prefilter's drops by family (summed over its CIDRs: a
        CIDR is an operator's input, never a label) and the CIDRs listed."""
        packets = CounterMetricFamily(
            "flagella_prefilter_drop_count",
            "Packets the XDP prefilter dropped (source in a listed CIDR), by family.",
            labels=("family",),
        )
        octets = CounterMetricFamily(
            "flagella_prefilter_drop_bytes",
            "Bytes the XDP prefilter dropped, by family.",
            labels=("family",),
        )
        cidrs = GaugeMetricFamily(
            "flagella_prefilter_cidrs",
            "CIDRs the XDP prefilter lists, by family.",
            labels=("family",),
        )
        for family, (n, p, b) in self.service.prefilter.totals().items():
            packets.add_metric((family,), p)
            octets.add_metric((family,), b)
            cidrs.add_metric((family,), n)
        yield from (packets, octets, cidrs)

    def node_health(self) -> Iterator[Metric]:
        status = GaugeMetricFamily(
            "flagella_node_health_connectivity_status",
            "Whether the last health probe reached the node (1) or not (0).",
            labels=("target_node_name",),
        )
        latency = GaugeMetricFamily(
            "flagella_node_health_connectivity_latency_seconds",
            "The last successful health probe's TCP connect time to the node.",
            labels=("target_node_name",),
        )
        for peer in self.service.health.peers.values():
            status.add_metric((peer.node,), 1.0 if peer.reachable else 0.0)
            if peer.reachable:
                latency.add_metric((peer.node,), peer.latency_s)
        yield from (status, latency)


def map_figures(bpf: Datapath) -> Iterator[Metric]:
    """Pressure and operations of every map, from the writers' and the
    GC's counts."""
    pressure = GaugeMetricFamily(
        "flagella_bpf_map_pressure",
        "Fill of a BPF map: entries in use over max entries (maps that cannot fill up have none).",
        labels=("map_name",),
    )
    ops = CounterMetricFamily(
        "flagella_bpf_map_ops_total",
        "Updates and deletes of a BPF map by this process, by outcome.",
        labels=("map_name", "operation", "outcome"),
    )
    for name, m in bpf.maps.items():
        fill = map_pressure(m.spec.type_name, bpf.entries_in_use(name), m.max_entries)
        if fill is not None:
            pressure.add_metric((name,), fill)
        for (operation, outcome), n in m.stats.ops.items():
            ops.add_metric((name, operation, outcome), n)
    yield from (pressure, ops)
