"""Logic of the datapath service (no gRPC here)."""

from __future__ import annotations

from flagella.datapath.config import DatapathConfig


class DatapathService:
    def __init__(self, config: DatapathConfig) -> None:
        self.config = config
