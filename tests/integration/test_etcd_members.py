"""Three etcd members (real processes), one killed with -9 under a load of
IP allocations, identity allocations and service writes, then restarted
(issue 18 item 2): every operation succeeds within its retry budget (the
retries are counted), no IP or identity is handed out twice, and every
acknowledged write is there at the end. The services are given all three
endpoints and fail over between them (flagella.common.etcd)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdCluster
from harness.lb import service
from harness.procs import SERVING, ServiceProcess
from harness.tls import session
from policy_client import pod_labels

from flagella.api.ipam.v1 import ipam_pb2 as ipam_pb
from flagella.api.ipam.v1 import ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2 as lb_pb
from flagella.api.lb.v1 import lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2 as policy_pb
from flagella.api.policy.v1 import policy_pb2_grpc
from flagella.common import pki
from flagella.common.backoff import Backoff

pytestmark = pytest.mark.integration

#: What a client retries (etcd member lost, leader changed): the call's
#: status says "try again".
TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
}
#: Each operation's retry budget, in seconds.
BUDGET_S = 30.0
#: Operations of each kind acknowledged per phase (before the kill, while
#: the member is down, after its return).
PER_PHASE = 25
#: At most this many of each kind (a node's /24 holds 254 addresses).
CAP = 200


@dataclass
class Load:
    acked: dict[str, list[tuple[int, Any]]] = field(
        default_factory=lambda: {"ip": [], "identity": [], "service": []}
    )
    retries: dict[str, int] = field(default_factory=lambda: {"ip": 0, "identity": 0, "service": 0})
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def call(self, kind: str, n: int, op: Callable[[], Awaitable[Any]]) -> None:
        deadline = time.monotonic() + BUDGET_S
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                result = await op()
            except grpc.aio.AioRpcError as exc:
                if exc.code() in TRANSIENT and time.monotonic() < deadline:
                    self.retries[kind] += 1
                    await backoff.wait()
                    continue
                self.failures.append(f"{kind} {n}: {exc.code().name} {exc.details()}")
                return
            self.acked[kind].append((n, result))
            return

    async def until(self, count: int, timeout: float = 60.0) -> None:
        """Until every kind has `count` acknowledged operations."""
        deadline = time.monotonic() + timeout
        while min(len(v) for v in self.acked.values()) < count:
            assert not self.failures, self.failures
            assert time.monotonic() < deadline, {k: len(v) for k, v in self.acked.items()}
            await asyncio.sleep(0.05)


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path).start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


def test_member_killed_and_restarted_under_load(
    etcd_cluster: EtcdCluster, spawn: Callable[..., ServiceProcess]
) -> None:
    # Every service starts on the first member (its first endpoint): the
    # one killed.
    endpoints = ["--etcd-endpoints", ",".join(etcd_cluster.endpoints)]
    ipam = spawn("ipam", *endpoints, "--cluster-cidr", "10.220.0.0/16")
    policy = spawn("policy", *endpoints, "--lb-address", "")
    lb = spawn("lb", *endpoints)
    victim = etcd_cluster.members[0]
    figures = asyncio.run(run_load(ipam, policy, lb, victim))
    load, listed = figures
    assert not load.failures, load.failures

    # No IP or identity handed out twice; nothing acknowledged is missing.
    ips = [ip for _, ip in load.acked["ip"]]
    assert len(set(ips)) == len(ips)
    assert listed["ip"] == {f"c{n}": ip for n, ip in load.acked["ip"]}
    ids = [ident for _, ident in load.acked["identity"]]
    assert len(set(ids)) == len(ids)
    assert all(listed["identity"][ident] == f"l{n}" for n, ident in load.acked["identity"])
    assert {f"load/s{n}" for n, _ in load.acked["service"]} <= listed["service"]
    for proc in (ipam, policy, lb):
        assert proc.health() == SERVING, proc.logs()
    print(
        json.dumps(
            {
                "acked": {k: len(v) for k, v in load.acked.items()},
                "retries": load.retries,
            }
        )
    )


async def run_load(
    ipam: ServiceProcess, policy: ServiceProcess, lb: ServiceProcess, victim: Any
) -> tuple[Load, dict[str, Any]]:
    tls = session()
    ipam_ch = tls.aio_channel(ipam.address, pki.service("endpoint"))
    node_ch = tls.aio_channel(ipam.address, pki.node("m-node"))
    policy_ch = tls.aio_channel(policy.address, pki.service("endpoint"))
    operator_policy_ch = tls.aio_channel(policy.address)
    lb_ch = tls.aio_channel(lb.address)
    ipam_stub = ipam_pb2_grpc.IpamServiceStub(ipam_ch)
    policy_stub = policy_pb2_grpc.PolicyServiceStub(policy_ch)
    lb_stub = lb_pb2_grpc.LoadBalancerServiceStub(lb_ch)
    register = ipam_pb.RegisterNodeRequest(name="m-node", datapath_address="unix:/none.sock")
    register.lease_ttl.seconds = 3600
    await ipam_pb2_grpc.IpamServiceStub(node_ch).RegisterNode(register, timeout=20)

    load = Load()

    async def allocate(n: int) -> str:
        resp = await ipam_stub.Allocate(
            ipam_pb.AllocateRequest(
                node="m-node", owner=ipam_pb.Owner(container_id=f"c{n}", ifname="eth0")
            ),
            timeout=10,
        )
        return resp.allocations[0].ip

    async def identity(n: int) -> int:
        resp = await policy_stub.AllocateIdentity(
            policy_pb.AllocateIdentityRequest(
                labels=pod_labels("load", app=f"l{n}"), node="m-node", owner=f"o{n}"
            ),
            timeout=10,
        )
        return resp.identity.id

    async def upsert(n: int) -> int:
        svc = service(f"load/s{n}", f"10.96.{n // 250}.{n % 250 + 1}", 80, [("10.9.0.1", 80)])
        resp = await lb_stub.UpsertService(lb_pb.UpsertServiceRequest(service=svc), timeout=10)
        return resp.service.id

    kinds: dict[str, Callable[[int], Awaitable[Any]]] = {
        "ip": allocate,
        "identity": identity,
        "service": upsert,
    }
    counters = dict.fromkeys(kinds, 0)

    async def worker(kind: str) -> None:
        while not load.stop.is_set() and counters[kind] < CAP:
            n = counters[kind]
            counters[kind] += 1
            await load.call(kind, n, functools.partial(kinds[kind], n))

    workers = [asyncio.create_task(worker(k)) for k in kinds for _ in range(3)]
    try:
        await load.until(PER_PHASE)
        victim.stop(kill=True)
        await load.until(2 * PER_PHASE)
        await asyncio.to_thread(victim.start, 30)
        await load.until(3 * PER_PHASE)
    finally:
        load.stop.set()
        await asyncio.gather(*workers)

    listed: dict[str, Any] = {}
    allocations = await ipam_stub.ListAllocations(
        ipam_pb.ListAllocationsRequest(node="m-node"), timeout=20
    )
    listed["ip"] = {a.owner.container_id: a.ip for a in allocations.allocations}
    identities = await policy_pb2_grpc.PolicyServiceStub(operator_policy_ch).ListIdentities(
        policy_pb.ListIdentitiesRequest(), timeout=20
    )
    listed["identity"] = {
        i.id: next((lb.value for lb in i.labels if lb.key == "app"), "")
        for i in identities.identities
    }
    services = await lb_stub.ListServices(lb_pb.ListServicesRequest(), timeout=20)
    listed["service"] = {s.name for s in services.services}
    for ch in (ipam_ch, node_ch, policy_ch, operator_policy_ch, lb_ch):
        await ch.close()
    return load, listed
