"""The endpoint service's Prometheus figures: endpoints by state, read at
each scrape from the replica's table of etcd's endpoints (Cilium's
cilium_endpoint_state), and the latency of each CNI operation this service
handles, by command and outcome (a histogram)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flagella.cni import (
    DECODING_FAILURE,
    ENDPOINT_FAILED,
    INCOMPATIBLE_VERSION,
    INVALID_ENVIRONMENT,
    INVALID_NETWORK_CONFIG,
    IO_FAILURE,
    PLUGIN_NOT_AVAILABLE,
    TRY_AGAIN_LATER,
    UNKNOWN_CONTAINER,
    UNSUPPORTED_FIELD,
)
from flagella.common.metrics import outcome_histogram
from flagella.common.sync import Table
from flagella.endpoint.model import Endpoint, State

# A CNI operation: an ADD that waits for policy takes seconds, a VERSION
# a millisecond.
CNI_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COMMANDS = frozenset({"ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION"})
# The spec's error codes, by name: the outcome of a failed operation.
OUTCOMES = {
    INCOMPATIBLE_VERSION: "incompatible_version",
    UNSUPPORTED_FIELD: "unsupported_field",
    UNKNOWN_CONTAINER: "unknown_container",
    INVALID_ENVIRONMENT: "invalid_environment",
    IO_FAILURE: "io_failure",
    DECODING_FAILURE: "decoding_failure",
    INVALID_NETWORK_CONFIG: "invalid_network_config",
    TRY_AGAIN_LATER: "try_again_later",
    PLUGIN_NOT_AVAILABLE: "plugin_not_available",
    ENDPOINT_FAILED: "endpoint_failed",
}


def cni_labels(command: str, error_code: int | None) -> tuple[str, str]:
    """(command, outcome) of one CNI operation, each from a fixed set
    whatever the runtime sent: an unknown command is "unknown", an
    unknown error code "error"."""
    outcome = "success" if error_code is None else OUTCOMES.get(error_code, "error")
    return (command if command in COMMANDS else "unknown"), outcome


class CniLatency:
    """flagella_cni_operation_duration_seconds{command,outcome}."""

    def __init__(self, registry: CollectorRegistry) -> None:
        name = "flagella_cni_operation_duration_seconds"
        what = "the CNI operations the endpoint service handles"
        self.seconds = outcome_histogram(registry, name, what, "command", CNI_BUCKETS)

    def observe(self, command: str, error_code: int | None, seconds: float) -> None:
        self.seconds.labels(*cni_labels(command, error_code)).observe(seconds)


class EndpointCollector(Collector):
    """Endpoints by state: every endpoint of the cluster (etcd's, as this
    replica's table holds them), so every replica reports the same."""

    def __init__(self, endpoints: Table[str, Endpoint]) -> None:
        self.endpoints = endpoints

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily(
            "flagella_endpoint_state",
            "Endpoints of the cluster, by state.",
            labels=("state",),
        )
        counts = Counter(ep.state for ep in self.endpoints.values())
        for state in State:
            states.add_metric((state.value,), counts.get(state, 0))
        yield states
