"""Configuration of the relay service."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.addresses import address_option
from flagella.common.config import ServiceConfig, option, parse_host_port
from flagella.common.errors import ConfigError
from flagella.relay.service import Settings


def parse_listen_or_off(value: str) -> str:
    """host:port, or empty: off."""
    return parse_host_port(value) if value else ""


@dataclass(frozen=True)
class RelayConfig(ServiceConfig):
    """flagella relay service: every node's flows through one API, merged in
    time order (as Hubble Relay)."""

    USES_ETCD = False  # nodes come from ipam

    listen: str = option("127.0.0.1:50056", "gRPC address to serve on", parse=parse_host_port)
    metrics_listen: str = option(
        "127.0.0.1:9966",
        "serve Prometheus metrics (GET /metrics, HTTP) here; empty: off",
        parse=parse_host_port,
    )
    ipam_address: str = address_option("127.0.0.1:50051", "ipam service (its node registry)")
    ui_listen: str = option(
        "127.0.0.1:12000",
        "serve the flows web page (HTTP, no authentication: anyone who reaches it sees "
        "every flow) here; loopback by default, reach it by port-forward; empty: off",
        parse=parse_listen_or_off,
    )
    ui_allowed_hosts: tuple[str, ...] = option(
        (),
        "host names the page may be asked for besides IP addresses and localhost "
        "(comma-separated; a request naming another is refused: DNS rebinding)",
    )
    endpoint_address: str = address_option(
        "127.0.0.1:50053", "endpoint service (pod names of the page's flows)"
    )
    policy_address: str = address_option(
        "127.0.0.1:50052", "policy service (identity labels of the page's flows)"
    )
    lb_address: str = address_option(
        "127.0.0.1:50054", "lb service (the services the page's flows are addressed to)"
    )
    node_buffer_size: int = option(
        2048, "flows buffered per node for a slow reader (then the oldest are dropped)"
    )
    sort_buffer_max_len: int = option(
        1000, "flows held to sort every node's into time order (most)"
    )
    sort_buffer_drain_timeout: float = option(
        0.1, "seconds a flow waits at most in the sort buffer"
    )
    node_timeout: float = option(5.0, "seconds a node's datapath gets to answer")
    node_probe_interval: float = option(5.0, "seconds between checks of every node (GetNodes)")

    def validate(self) -> None:
        super().validate()
        for flag, value in (
            ("--node-buffer-size", self.node_buffer_size),
            ("--sort-buffer-max-len", self.sort_buffer_max_len),
        ):
            if value < 1:
                raise ConfigError(flag, "must be at least 1")
        for flag, seconds in (
            ("--sort-buffer-drain-timeout", self.sort_buffer_drain_timeout),
            ("--node-timeout", self.node_timeout),
            ("--node-probe-interval", self.node_probe_interval),
        ):
            if seconds <= 0:
                raise ConfigError(flag, "must be positive")
        if self.ui_listen.startswith("unix:"):
            raise ConfigError("--ui-listen", "the page is served over TCP (host:port)")

    @property
    def settings(self) -> Settings:
        return Settings(
            node_buffer_size=self.node_buffer_size,
            sort_buffer_max_len=self.sort_buffer_max_len,
            sort_buffer_drain_timeout=self.sort_buffer_drain_timeout,
            node_timeout=self.node_timeout,
        )
