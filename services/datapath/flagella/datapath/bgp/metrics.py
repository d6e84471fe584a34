"""The BGP speaker's Prometheus figures, read from what the speaker holds at
each scrape (never a call to gobgpd): whether it runs, its restarts, its
sessions by state (no label carries a peer's address), the prefixes it
lets out and what of its policies it could not apply. Cilium's agent
exports no BGP figures of its own; these follow its style."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.datapath.bgp.gobgp import STATES
from flagella.datapath.bgp.speaker import Speaker


class BgpCollector(Collector):
    def __init__(self, speaker: Speaker) -> None:
        self.speaker = speaker

    def collect(self) -> Iterator[Metric]:
        sp = self.speaker
        want = sp.desired
        up = GaugeMetricFamily(
            "flagella_bgp_speaker_up",
            "1 while the node's BGP speaker (gobgpd) runs reconciled to its peering policies.",
        )
        up.add_metric((), 1.0 if sp.state == "running" else 0.0)
        yield up
        restarts = CounterMetricFamily(
            "flagella_bgp_speaker_restarts",
            "Times gobgpd was started again after it died or stopped answering.",
        )
        restarts.add_metric((), sp.restarts)
        yield restarts
        sessions = GaugeMetricFamily(
            "flagella_bgp_sessions",
            "The speaker's BGP sessions by state (as gobgpd last reported each).",
            labels=("state",),
        )
        counts = dict.fromkeys(STATES.values(), 0)
        for address in want.peers if want else ():
            state = sp.peer_states.get(address, "unknown") if sp.state == "running" else "unknown"
            counts[state] = counts.get(state, 0) + 1
        for state, n in sorted(counts.items()):
            sessions.add_metric((state,), n)
        yield sessions
        routes = GaugeMetricFamily(
            "flagella_bgp_routes_advertised",
            "Prefixes the speaker's export policies let out, summed over its peers.",
        )
        routes.add_metric((), sp.advertised_count())
        yield routes
        skipped = GaugeMetricFamily(
            "flagella_bgp_not_applied",
            "Parts of the peering policies selecting this node it could not apply (GetBgpPeers "
            "says which and why).",
        )
        skipped.add_metric((), len(sp.not_applied()))
        yield skipped
