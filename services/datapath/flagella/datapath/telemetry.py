"""The datapath's figures measured as work happens (the collector in
metrics.py reads the rest at each scrape): endpoint regeneration time by
scope, policy implementation delay, conntrack GC runs, entries and
duration. Names and labels as Cilium's (docs/metrics.md, datapath)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Programming an endpoint takes milliseconds: finer than DefBuckets below.
REGENERATION_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# The scopes of a regeneration (bounded): on ADD, waiting for the
# endpoint's lock, the veth pair, the endpoint's map entries, the programs'
# attachment, and all of it; on ADD or a policy change, one endpoint's
# policy entries written.
SCOPES = ("lock", "veth", "maps", "attach", "total", "policy")
FAMILIES = ("ipv4", "ipv6")


class DatapathMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.regeneration = Histogram(
            "flagella_endpoint_regeneration_time_stats_seconds",
            "Time the datapath took to program an endpoint, by scope.",
            ("scope",),
            buckets=REGENERATION_BUCKETS,
            registry=registry,
        )
        self.policy_delay = Histogram(
            "flagella_policy_implementation_delay",
            "Seconds from the policy service committing a policy revision to an "
            "endpoint of this node having it in its maps.",
            buckets=REGENERATION_BUCKETS,
            registry=registry,
        )
        self.gc_runs = Counter(
            "flagella_datapath_conntrack_gc_runs_total",
            "Conntrack GC passes, by status (completed, uncompleted).",
            ("status",),
            registry=registry,
        )
        self.gc_entries = Gauge(
            "flagella_datapath_conntrack_gc_entries",
            "Conntrack entries alive and deleted at the end of the last GC pass, by family.",
            ("family", "status"),
            registry=registry,
        )
        self.gc_duration = Histogram(
            "flagella_datapath_conntrack_gc_duration_seconds",
            "Duration of the conntrack GC passes, by status.",
            ("status",),
            buckets=REGENERATION_BUCKETS,
            registry=registry,
        )
        for scope in SCOPES:
            self.regeneration.labels(scope)
        for status in ("completed", "uncompleted"):
            self.gc_runs.labels(status)

    @contextlib.contextmanager
    def regenerating(self, scope: str) -> Iterator[None]:
        """Times the block as one regeneration of scope (when it succeeds)."""
        start = time.perf_counter()
        yield
        self.regeneration.labels(scope).observe(time.perf_counter() - start)

    def policy_implemented(self, revision_time: float) -> None:
        """An endpoint's maps hold a policy revision committed at
        revision_time (Unix time, the policy service's clock: the nodes'
        clocks are assumed in sync, as NTP keeps them; a negative skew
        counts as 0)."""
        self.policy_delay.observe(max(time.time() - revision_time, 0.0))

    def gc_done(self, seconds: float, alive: Mapping[str, int], deleted: Mapping[str, int]) -> None:
        self.gc_runs.labels("completed").inc()
        self.gc_duration.labels("completed").observe(seconds)
        for family in FAMILIES:
            self.gc_entries.labels(family, "alive").set(alive.get(family, 0))
            self.gc_entries.labels(family, "deleted").set(deleted.get(family, 0))

    def gc_failed(self, seconds: float) -> None:
        self.gc_runs.labels("uncompleted").inc()
        self.gc_duration.labels("uncompleted").observe(seconds)
