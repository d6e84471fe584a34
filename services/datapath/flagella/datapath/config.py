"""Configuration of the datapath service."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from flagella.common.config import ServiceConfig, option, parse_host_port, parse_ip


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
    policy_address: str = option("", "policy service (host:port)")
    lb_address: str = option("", "load-balancer service (host:port)")
