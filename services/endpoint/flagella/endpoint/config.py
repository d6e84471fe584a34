"""Configuration of the endpoint service."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.config import ServiceConfig, option, parse_host_port


@dataclass(frozen=True)
class EndpointConfig(ServiceConfig):
    """flagella endpoint service: endpoint lifecycle; orchestrates ipam, policy and the node's
    datapath for CNI."""

    listen: str = option("127.0.0.1:50053", "gRPC address to serve on", parse=parse_host_port)
