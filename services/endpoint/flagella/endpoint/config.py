"""Configuration of the endpoint service."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.addresses import address_option
from flagella.common.config import option, parse_host_port, parse_ip
from flagella.common.errors import ConfigError
from flagella.common.kubeapi import KubeConfig


@dataclass(frozen=True)
class EndpointConfig(KubeConfig):
    """flagella endpoint service: endpoint lifecycle; orchestrates ipam, policy
    and the node's datapath for CNI. With --kubeconfig: labels read at ADD
    and followed from the API server, endpoint status written to it."""

    listen: str = option("127.0.0.1:50053", "gRPC address to serve on", parse=parse_host_port)
    metrics_listen: str = option(
        "127.0.0.1:9963",
        "serve Prometheus metrics (GET /metrics, HTTP) here; empty: off",
        parse=parse_host_port,
    )
    ipam_address: str = address_option("127.0.0.1:50051", "ipam service")
    policy_address: str = address_option("127.0.0.1:50052", "policy service")
    reservation_seconds: float = option(
        120.0, "an IP reserved for an ADD that never completes is freed after this"
    )
    policy_wait_seconds: float = option(
        20.0, "how long an ADD waits for the node's datapath to realize the pod's policy"
    )
    gc_interval_seconds: float = option(
        60.0, "sweep for endpoints whose container is gone this often (0: never)"
    )
    dns_nameserver: tuple[str, ...] = option((), "DNS servers in CNI results", parse=parse_ip)
    dns_search: tuple[str, ...] = option((), "DNS search domains in CNI results")
    fault_injection: str = option(
        "",
        "tests only: crash-after:STEP or pause-after:STEP:SECONDS, STEP one of ipam, identity, "
        "datapath, ipcache, policy",
    )

    def validate(self) -> None:
        super().validate()
        if self.reservation_seconds <= 0:
            raise ConfigError("--reservation-seconds", "must be positive")
        if self.policy_wait_seconds <= 0:
            raise ConfigError("--policy-wait-seconds", "must be positive")
        if self.gc_interval_seconds < 0:
            raise ConfigError("--gc-interval-seconds", "must not be negative")
        if self.fault_injection:
            action, _, rest = self.fault_injection.partition(":")
            step, _, seconds = rest.partition(":")
            steps = ("ipam", "identity", "datapath", "ipcache", "policy")
            if action not in ("crash-after", "pause-after") or step not in steps:
                raise ConfigError(
                    "--fault-injection",
                    f"{self.fault_injection!r}: want crash-after:STEP or "
                    f"pause-after:STEP:SECONDS with STEP in {', '.join(steps)}",
                )
            if action == "pause-after":
                try:
                    float(seconds)
                except ValueError:
                    raise ConfigError("--fault-injection", "pause needs SECONDS") from None
