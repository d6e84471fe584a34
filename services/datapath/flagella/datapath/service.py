"""Logic of the datapath service (no gRPC here)."""

from __future__ import annotations

import logging

from flagella.api.ipam.v1 import ipam_pb2
from flagella.datapath.config import DatapathConfig

log = logging.getLogger(__name__)


class DatapathService:
    def __init__(self, config: DatapathConfig) -> None:
        self.config = config
        self.pod_cidrs: list[str] = []

    async def set_node(self, node: ipam_pb2.Node) -> None:
        """The registry's view of this node: its pod CIDRs."""
        self.pod_cidrs = list(node.pod_cidrs)
