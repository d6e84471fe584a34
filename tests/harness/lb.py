"""Helpers for tests of the lb service: building requests, a small client,
reading what it stored in etcd, and applying its watch stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.api.lb.v1 import lb_pb2_grpc
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess

LB_PREFIX = "flagella/lb/v1/"


def service(
    name: str,
    address: str,
    port: int = 80,
    backends: list[tuple[str, int]] | list[tuple[str, int, int]] | None = None,
    **kw: Any,
) -> pb.Service:
    svc = pb.Service(
        name=name,
        frontend=pb.Frontend(address=address, port=port, protocol=kw.pop("protocol", 6)),
        **kw,
    )
    for b in backends or []:
        svc.backends.append(
            pb.Backend(address=b[0], port=b[1], weight=b[2] if len(b) > 2 else 0)  # type: ignore[misc]
        )
    return svc


class LbClient:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = lb_pb2_grpc.LoadBalancerServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def upsert(self, svc: pb.Service, timeout: float = 20) -> pb.UpsertServiceResponse:
        return self.stub.UpsertService(pb.UpsertServiceRequest(service=svc), timeout=timeout)

    def get(self, name: str) -> pb.Service:
        return self.stub.GetService(pb.GetServiceRequest(name=name), timeout=10)

    def delete(self, name: str) -> bool:
        return self.stub.DeleteService(pb.DeleteServiceRequest(name=name), timeout=10).deleted

    def list(self, namespace: str = "") -> pb.ListServicesResponse:
        return self.stub.ListServices(pb.ListServicesRequest(namespace=namespace), timeout=20)

    def table(self, name: str) -> pb.MaglevTable:
        return self.stub.GetMaglevTable(pb.GetMaglevTableRequest(name=name), timeout=20)

    def watch(
        self, since: int = 0, tables: bool = False, timeout: float = 60, batch: bool = False
    ) -> Any:
        return self.stub.WatchServices(
            pb.WatchServicesRequest(
                since_revision=since, include_maglev_tables=tables, batch_events=batch
            ),
            timeout=timeout,
        )


def rpc_error(fn: Any, *args: Any, **kw: Any) -> grpc.RpcError:
    try:
        fn(*args, **kw)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def etcd_dump(server: EtcdServer, prefix: str = LB_PREFIX) -> dict[str, bytes]:
    """Every key under prefix and its value, read directly from etcd."""

    async def dump() -> dict[str, bytes]:
        etcd = server.client()
        try:
            kvs, _ = await etcd.get_prefix(prefix)
            return {kv.key: kv.value for kv in kvs}
        finally:
            await etcd.close()

    return asyncio.run(dump())


class WatchState:
    """What a datapath would hold after applying a WatchServices stream."""

    def __init__(self) -> None:
        self.services: dict[str, pb.Service] = {}
        self.tables: dict[str, pb.MaglevTable] = {}
        self.revision = 0
        self.synced = False
        self.removed_backend_ids: list[int] = []
        self.events: list[pb.ServiceEvent] = []
        self.batches = 0  # KIND_BATCH messages received

    def apply(self, ev: pb.ServiceEvent) -> None:
        kind = ev.kind
        if kind == pb.ServiceEvent.KIND_BATCH:
            # Listed as its events, one by one.
            self.batches += 1
            assert len(ev.events) > 1, "a lone event goes as itself"
            assert ev.revision == ev.events[-1].revision
            for inner in ev.events:
                assert inner.kind in (pb.ServiceEvent.KIND_UPSERT, pb.ServiceEvent.KIND_DELETE)
                self.apply(inner)
            return
        self.events.append(ev)
        if kind == pb.ServiceEvent.KIND_RESET:
            self.services.clear()
            self.tables.clear()
            self.synced = False
        elif kind == pb.ServiceEvent.KIND_UPSERT:
            self.services[ev.service.name] = ev.service
            if ev.HasField("maglev_table"):
                self.tables[ev.service.name] = ev.maglev_table
            else:
                self.tables.pop(ev.service.name, None)
            self.removed_backend_ids.extend(ev.removed_backend_ids)
        elif kind == pb.ServiceEvent.KIND_DELETE:
            self.services.pop(ev.service.name, None)
            self.tables.pop(ev.service.name, None)
            self.removed_backend_ids.extend(ev.removed_backend_ids)
        elif kind == pb.ServiceEvent.KIND_SYNCED:
            self.synced = True
        self.revision = max(self.revision, ev.revision)

    def follow(self, stream: Iterator[pb.ServiceEvent], until_revision: int = 0) -> WatchState:
        """Apply events until synced and at or past until_revision."""
        for ev in stream:
            self.apply(ev)
            if self.synced and self.revision >= until_revision:
                break
        return self


def wait_for(cond: Any, timeout: float = 20.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@contextlib.contextmanager
def lb_with_etcd(tmp: Path, *args: str) -> Iterator[tuple[EtcdServer, LbClient]]:
    """A fresh etcd and one lb process on it (extra lb flags in args), and a
    client; all stopped and removed at the end. Plaintext: the client
    plays every role (docs/DEVELOPMENT.md)."""
    etcd = EtcdServer(tmp / "etcd").start()
    proc = ServiceProcess(
        "lb", ["--etcd-endpoints", etcd.endpoint, *args], log_dir=tmp, insecure=True
    )
    client = None
    try:
        proc.start().wait_serving()
        client = LbClient(proc.address)
        yield etcd, client
    finally:
        if client is not None:
            client.close()
        proc.stop()
        etcd.cleanup()
