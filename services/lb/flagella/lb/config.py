"""Configuration of the lb service."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.config import ServiceConfig, option, parse_host_port


@dataclass(frozen=True)
class LbConfig(ServiceConfig):
    """flagella lb service: services, backends, stable ids and Maglev tables."""

    listen: str = option("127.0.0.1:50054", "gRPC address to serve on", parse=parse_host_port)
