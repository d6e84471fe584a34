"""Logic of the ipam service (no gRPC here)."""

from __future__ import annotations

from flagella.ipam.store import IpamStore


class IpamService:
    def __init__(self, store: IpamStore) -> None:
        self.store = store
