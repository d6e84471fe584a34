"""etcd state of the ipam service."""

from __future__ import annotations

from flagella.common.etcd import Etcd

PREFIX = "flagella/ipam/v1/"


class IpamStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
