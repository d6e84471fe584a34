"""The relay's Prometheus figures, read from its own state at each scrape:
flows received from each node and passed on to readers, flows lost from a
node's full buffer, the nodes by state, the web page's open streams.
Labels: node names (as many as nodes) and a few fixed values."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.relay.service import Relay

STATES = {True: "connected", False: "unavailable", None: "unknown"}


class RelayCollector(Collector):
    def __init__(self, relay: Relay, ui_clients: Callable[[], int]) -> None:
        self.relay = relay
        self.ui_clients = ui_clients

    def collect(self) -> Iterator[Metric]:
        relay = self.relay
        received = CounterMetricFamily(
            "flagella_relay_flows_received",
            "Flows the relay received from each node's datapath.",
            labels=("node",),
        )
        for name, view in sorted(relay.views.items()):
            received.add_metric((name,), view.flows_seen)
        forwarded = CounterMetricFamily(
            "flagella_relay_flows_forwarded",
            "Flows the relay passed on to its readers (each reader counts its own).",
        )
        forwarded.add_metric((), relay.forwarded)
        lost = CounterMetricFamily(
            "flagella_relay_flows_lost",
            "Flows the relay dropped, by node and reason (queue_full: the node's "
            "buffer was full, its reader slower than the nodes).",
            labels=("node", "reason"),
        )
        for name, count in sorted(relay.lost.items()):
            lost.add_metric((name, "queue_full"), count)
        states: Counter[str] = Counter(STATES[v.connected] for v in relay.node_views())
        nodes = GaugeMetricFamily(
            "flagella_relay_nodes",
            "Nodes of the registry, by the relay's view of their datapath.",
            labels=("state",),
        )
        for state in STATES.values():
            nodes.add_metric((state,), states.get(state, 0))
        clients = GaugeMetricFamily(
            "flagella_relay_ui_clients", "Flow streams the web page has open."
        )
        clients.add_metric((), self.ui_clients())
        yield from (received, forwarded, lost, nodes, clients)
