"""Configuration of the ipam service."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from flagella.common.config import ServiceConfig, option, parse_cidr, parse_host_port
from flagella.common.errors import ConfigError


@dataclass(frozen=True)
class IpamConfig(ServiceConfig):
    """flagella ipam service: node registry, per-node pod CIDRs and IP
    allocations."""

    listen: str = option("127.0.0.1:50051", "gRPC address to serve on", parse=parse_host_port)
    metrics_listen: str = option(
        "127.0.0.1:9961",
        "serve Prometheus metrics (GET /metrics, HTTP) here; empty: off",
        parse=parse_host_port,
    )
    mode: str = option(
        "cluster-pool",
        "cluster-pool: carve node CIDRs from --cluster-cidr; host-scope: each node's CIDR is given",
        choices=("cluster-pool", "host-scope"),
    )
    cluster_cidr: tuple[str, ...] = option(
        ("10.244.0.0/16",),
        "cluster CIDRs, IPv4 and/or IPv6, several allowed (cluster-pool mode)",
        parse=parse_cidr,
    )
    node_mask_size_v4: int = option(24, "prefix length of each node's IPv4 pod CIDR")
    node_mask_size_v6: int = option(112, "prefix length of each node's IPv6 pod CIDR")
    node_lease_ttl: int = option(30, "seconds a node registration lives without renewal")
    expiry_check_interval: float = option(
        1.0, "seconds between sweeps that free expired IP reservations"
    )
    kubeconfig: str = option(
        "",
        "host-scope: read a node's spec.podCIDRs from Kubernetes with this kubeconfig "
        "('in-cluster' inside a pod); empty: the CIDRs come with RegisterNode",
    )

    def validate(self) -> None:
        super().validate()
        if self.node_lease_ttl < 2:
            raise ConfigError("--node-lease-ttl", "must be at least 2 seconds")
        if self.expiry_check_interval <= 0:
            raise ConfigError("--expiry-check-interval", "must be positive")
        if self.mode != "cluster-pool":
            return
        if not self.cluster_cidr:
            raise ConfigError("--cluster-cidr", "cluster-pool mode needs at least one CIDR")
        nets = [ipaddress.ip_network(c) for c in self.cluster_cidr]
        for i, net in enumerate(nets):
            # Overlapping ranges would make one address two nodes' candidate.
            clash = next(
                (o for o in nets[:i] if o.version == net.version and o.overlaps(net)), None
            )
            if clash is not None:
                raise ConfigError("--cluster-cidr", f"{net} overlaps {clash}")
        for cidr in self.cluster_cidr:
            net = ipaddress.ip_network(cidr)
            opt, mask, max_mask = (
                ("--node-mask-size-v4", self.node_mask_size_v4, 30)
                if net.version == 4
                else ("--node-mask-size-v6", self.node_mask_size_v6, 126)
            )
            if mask < net.prefixlen:
                raise ConfigError(
                    opt,
                    f"{mask} is larger than the range: cluster CIDR {cidr} is a /{net.prefixlen}",
                )
            if mask > max_mask:
                raise ConfigError(opt, f"{mask} leaves no room for pods (at most {max_mask})")
