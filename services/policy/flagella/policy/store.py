"""etcd state of the policy service."""

from __future__ import annotations

from flagella.common.etcd import Etcd

PREFIX = "flagella/policy/v1/"


class PolicyStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
