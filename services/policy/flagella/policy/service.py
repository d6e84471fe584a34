"""Logic of the policy service (no gRPC here)."""

from __future__ import annotations

from flagella.policy.store import PolicyStore


class PolicyService:
    def __init__(self, store: PolicyStore) -> None:
        self.store = store
