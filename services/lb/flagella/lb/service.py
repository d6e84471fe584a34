"""Logic of the lb service (no gRPC here)."""

from __future__ import annotations

from flagella.lb.store import LbStore


class LbService:
    def __init__(self, store: LbStore) -> None:
        self.store = store
