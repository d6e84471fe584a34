"""Configuration of the datapath service."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from flagella.common.config import ServiceConfig, option, parse_host_port, parse_ip
from flagella.common.errors import ConfigError
from flagella.common.pki import Identity


@dataclass(frozen=True)
class DatapathConfig(ServiceConfig):
    """flagella datapath service: the privileged eBPF datapath of one node."""

    listen: str = option("127.0.0.1:50055", "gRPC address to serve on", parse=parse_host_port)
    node_name: str = option(socket.gethostname(), "name of this node in the node registry")
    node_ip: tuple[str, ...] = option(
        (), "this node's internal IPs (one per family)", parse=parse_ip
    )
    advertise_address: str = option(
        "",
        "host:port other services reach this datapath at (default: --listen)",
        parse=parse_host_port,
    )
    ipam_address: str = option("", "ipam service (host:port); empty: do not register the node")
    policy_address: str = option("", "policy service (host:port); empty: no policy stream")
    lb_address: str = option("", "load-balancer service (host:port); empty: no services")
    endpoint_address: str = option(
        "", "endpoint service, where flagella-cni's calls are relayed; empty: no CNI socket"
    )
    cni_socket: str = option(
        "/run/flagella/cni.sock", "unix socket flagella-cni talks to (root only, mode 0600)"
    )
    bpf_root: str = option("/sys/fs/bpf/flagella", "bpffs folder the maps are pinned under")
    state_dir: str = option(
        "/var/run/flagella/datapath", "folder of endpoint records (restored after a restart)"
    )
    uplink: str = option("", "the node's uplink interface (masquerade and NodePort run on it)")
    masquerade: bool = option(True, "SNAT pod traffic leaving the cluster to the node address")
    enable_ip_forward: bool = option(True, "turn on IP forwarding in the node's netns")
    proc_sys: str = option(
        "/proc/sys",
        "where sysctls are written (in a container: a rw mount of the host's /proc/sys)",
    )
    gc_interval_seconds: float = option(30.0, "conntrack and NAT garbage collection period")

    def tls_identity(self, service: str) -> Identity:
        # The datapath registers its node (and asks for its node's policy):
        # it holds the node's certificate.
        return Identity("node", self.node_name)

    def validate(self) -> None:
        super().validate()
        if not self.node_name:
            raise ConfigError("--node-name", "must not be empty")
        if not self.cni_socket.startswith("/") or len(self.cni_socket.encode()) > 107:
            raise ConfigError("--cni-socket", "must be an absolute path of at most 107 bytes")
        try:
            self.tls_identity("datapath")  # its certificate names it
        except ValueError as exc:
            raise ConfigError("--node-name", str(exc)) from None
        if self.gc_interval_seconds <= 0:
            raise ConfigError("--gc-interval-seconds", "must be positive")
