"""Configuration of the policy service."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.config import ServiceConfig, option, parse_host_port


@dataclass(frozen=True)
class PolicyConfig(ServiceConfig):
    """flagella policy service: security identities, the ipcache, network policy
    rules and their resolution."""

    listen: str = option("127.0.0.1:50052", "gRPC address to serve on", parse=parse_host_port)
