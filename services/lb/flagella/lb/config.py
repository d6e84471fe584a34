"""Configuration of the lb service."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.config import option, parse_host_port
from flagella.common.errors import ConfigError
from flagella.common.kubeapi import KubeConfig
from flagella.lb.maglev import (
    DEFAULT_SEED,
    DEFAULT_SIZE,
    SUPPORTED_SIZES,
    parse_seed,
    supported_sizes_text,
)
from flagella.lb.model import Algorithm
from flagella.lb.validation import Limits

MAX_BACKENDS_LIMIT = 3072  # keeps a service's etcd transaction under 128 operations


def parse_port_range(value: str) -> str:
    """LOW-HIGH, both ports, LOW <= HIGH (Kubernetes' --service-node-port-range)."""
    low, sep, high = value.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"{value!r} is not a port range LOW-HIGH")
    lo, hi = int(low), int(high)
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"{value!r} is not a port range within 1-65535, low <= high")
    return f"{lo}-{hi}"


def _parse_seed(value: str) -> str:
    parse_seed(value)
    return value


@dataclass(frozen=True)
class LbConfig(KubeConfig):
    """flagella lb service: services, backends, stable ids and Maglev tables
    (with --kubeconfig: of Kubernetes Services and EndpointSlices)."""

    listen: str = option("127.0.0.1:50054", "gRPC address to serve on", parse=parse_host_port)
    metrics_listen: str = option(
        "127.0.0.1:9964",
        "serve Prometheus metrics (GET /metrics, HTTP) here; empty: off",
        parse=parse_host_port,
    )
    node_port_range: str = option(
        "30000-32767", "range of NodePort ports, LOW-HIGH", parse=parse_port_range
    )
    lb_algorithm: str = option(
        "random",
        "algorithm of services that name none (random or maglev)",
        choices=("random", "maglev"),
    )
    maglev_table_size: int = option(
        DEFAULT_SIZE,
        f"default Maglev table size M, a prime among {supported_sizes_text()}",
    )
    maglev_hash_seed: str = option(
        DEFAULT_SEED,
        "base64 of 12 bytes seeding the Maglev permutations; the same on every replica",
        parse=_parse_seed,
    )
    max_backends_per_service: int = option(
        2048, f"most backends one service may have (at most {MAX_BACKENDS_LIMIT})"
    )
    maglev_cache_mb: int = option(256, "memory for built Maglev tables, MiB")
    watch_heartbeat: float = option(
        30.0, "seconds between SYNCED heartbeats on an idle WatchServices stream"
    )

    bgp_secrets_namespace: str = option(
        "kube-system",
        "with --kubeconfig: the namespace of the Secrets CiliumBGPPeeringPolicy "
        "neighbours name in authSecretRef (key 'password'), as Cilium's bgpSecretsNamespace "
        "(k8s/: the lb's own, where its Role names the Secrets it may read)",
    )

    def validate(self) -> None:
        super().validate()
        if self.maglev_table_size not in SUPPORTED_SIZES:
            raise ConfigError(
                "--maglev-table-size",
                f"{self.maglev_table_size} is not one of {supported_sizes_text()}",
            )
        if not 1 <= self.max_backends_per_service <= MAX_BACKENDS_LIMIT:
            raise ConfigError(
                "--max-backends-per-service", f"must be within 1-{MAX_BACKENDS_LIMIT}"
            )
        if self.maglev_cache_mb < 1:
            raise ConfigError("--maglev-cache-mb", "must be at least 1")
        if self.watch_heartbeat <= 0:
            raise ConfigError("--watch-heartbeat", "must be positive")

    @property
    def seed(self) -> bytes:
        return parse_seed(self.maglev_hash_seed)

    @property
    def limits(self) -> Limits:
        lo, _, hi = self.node_port_range.partition("-")
        return Limits(
            node_port_min=int(lo),
            node_port_max=int(hi),
            max_backends=self.max_backends_per_service,
            default_algorithm=Algorithm(self.lb_algorithm),
            default_table_size=self.maglev_table_size,
        )

    @property
    def table_cache_slots(self) -> int:
        # A built table is a list of ints: about 8 bytes a slot.
        return self.maglev_cache_mb * (1 << 20) // 8
