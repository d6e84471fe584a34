"""etcd state of the lb service."""

from __future__ import annotations

from flagella.common.etcd import Etcd

PREFIX = "flagella/lb/v1/"


class LbStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
