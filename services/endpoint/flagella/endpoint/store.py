"""etcd state of the endpoint service."""

from __future__ import annotations

from flagella.common.etcd import Etcd

PREFIX = "flagella/endpoint/v1/"


class EndpointStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
