"""Helpers of the ipam integration tests: a blocking client with shorthands,
and assertions on gRPC errors (code, and the field the message names)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess

from flagella.api.ipam.v1 import ipam_pb2 as pb
from flagella.api.ipam.v1 import ipam_pb2_grpc as pbg

V4 = pb.FAMILY_IPV4
V6 = pb.FAMILY_IPV6


def ipam_args(etcd: EtcdServer, *extra: str) -> list[str]:
    return [
        "--etcd-endpoints", etcd.endpoint,
        "--etcd-timeout", "2",
        "--expiry-check-interval", "0.2",
        "--log-level", "info",
        *extra,
    ]  # fmt: skip


def owner(cid: str, ifname: str = "eth0", pod: str = "") -> pb.Owner:
    return pb.Owner(container_id=cid, ifname=ifname, pod=pod)


class Ipam:
    """A blocking client of one ipam process."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pbg.IpamServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def register(self, name: str, **kwargs: Any) -> pb.Node:
        return self.stub.RegisterNode(pb.RegisterNodeRequest(name=name, **kwargs), timeout=10).node

    def allocate(
        self,
        node: str,
        cid: str,
        families: Iterable[int] = (),
        *,
        ifname: str = "eth0",
        expiration: float = 0,
    ) -> list[pb.Allocation]:
        req = pb.AllocateRequest(node=node, owner=owner(cid, ifname), families=list(families))
        if expiration:
            req.expiration.FromNanoseconds(int(expiration * 1e9))
        return list(self.stub.Allocate(req, timeout=10).allocations)

    def allocate_ip(self, node: str, ip: str, cid: str, *, expiration: float = 0) -> pb.Allocation:
        req = pb.AllocateIPRequest(node=node, ip=ip, owner=owner(cid))
        if expiration:
            req.expiration.FromNanoseconds(int(expiration * 1e9))
        return self.stub.AllocateIP(req, timeout=10).allocation

    def commit(self, node: str, cid: str, ifname: str = "eth0") -> list[pb.Allocation]:
        req = pb.CommitAllocationRequest(node=node, owner=owner(cid, ifname))
        return list(self.stub.CommitAllocation(req, timeout=10).allocations)

    def release_ip(self, node: str, ip: str, *, force: bool = False) -> list[pb.Allocation]:
        req = pb.ReleaseRequest(node=node, ip=ip, force=force)
        return list(self.stub.Release(req, timeout=10).released)

    def release_owner(self, node: str, cid: str, ifname: str = "eth0") -> list[pb.Allocation]:
        req = pb.ReleaseRequest(node=node, owner=owner(cid, ifname))
        return list(self.stub.Release(req, timeout=10).released)

    def allocations(self, node: str = "", family: int = 0) -> list[pb.Allocation]:
        return list(self.listing(node, family).allocations)

    def listing(self, node: str = "", family: int = 0) -> pb.ListAllocationsResponse:
        req = pb.ListAllocationsRequest(node=node, family=family)
        return self.stub.ListAllocations(req, timeout=10)

    def revision(self) -> int:
        """etcd's store revision (any write anywhere moves it)."""
        return self.listing().revision

    def nodes(self) -> dict[str, pb.Node]:
        return {n.name: n for n in self.stub.ListNodes(pb.ListNodesRequest(), timeout=10).nodes}


def expect_error(code: grpc.StatusCode, field: str, call: Callable[[], object]) -> str:
    """Run call; assert it fails with code and a message that names field.
    Returns the message."""
    try:
        call()
    except grpc.RpcError as exc:
        got, details = exc.code(), exc.details()
        assert got == code, f"expected {code.name}, got {got.name}: {details}"
        assert details.startswith(f"{field}: "), f"message does not name {field!r}: {details}"
        return str(details)
    raise AssertionError(f"expected {code.name} naming {field}, the call succeeded")


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    assert predicate(), "condition not reached in time"


def spawn_ipam(
    spawn: Callable[..., ServiceProcess], etcd: EtcdServer, *extra: str
) -> tuple[ServiceProcess, Ipam]:
    proc = spawn("ipam", *ipam_args(etcd, *extra))
    return proc, Ipam(proc.address)
