"""Logic of the endpoint service (no gRPC here)."""

from __future__ import annotations

from flagella.endpoint.store import EndpointStore


class EndpointService:
    def __init__(self, store: EndpointStore) -> None:
        self.store = store
