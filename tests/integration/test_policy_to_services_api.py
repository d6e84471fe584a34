"""toServices through real processes (policy and lb, real etcd, mutual
TLS: the policy service dials lb with its own certificate): the policy
service starts and is ready without lb, the rule selects nothing until lb's
services are there, then the resolved policy's prefix entries follow the
service's backends (a backend replaced, the service deleted) within a
second, on ResolvePolicy and on a WatchPolicy stream, a resumed one
included."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.lb import service
from harness.net import free_port
from harness.procs import ServiceProcess
from policy_client import pod_labels

from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg
from flagella.common import pki

pytestmark = pytest.mark.integration

Spawn = Callable[..., ServiceProcess]

RULES = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-db, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toServices: [{k8sService: {serviceName: db}}]
    toPorts: [{ports: [{port: "5432", protocol: TCP}]}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-data, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: report}}
  egress:
  - toServices: [{k8sServiceSelector: {selector: {matchLabels: {tier: data}}}}]
"""

Prefixes = dict[str, tuple[tuple[int, int, int], ...]]


def prefixes(policy: pb.ResolvedPolicy) -> Prefixes:
    return {
        e.prefix: tuple((p.port, p.end_port, p.protocol) for p in e.ports)
        for e in policy.prefix_entries
    }


async def until(get: Callable[[], Any], want: Any, timeout: float) -> float:
    """Seconds until `await get()` equals want (fails after timeout)."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        last = await get()
        if last == want:
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError(f"still {last!r}, not {want!r}, after {timeout}s")


class Watch:
    """One node's WatchPolicy stream: the last policy of each identity."""

    def __init__(self, s: pbg.PolicyServiceStub, since: int = 0) -> None:
        self.call = s.WatchPolicy(pb.WatchPolicyRequest(node="n1", since_revision=since))
        self.events: AsyncIterator[pb.PolicyEvent] = self.call.__aiter__()
        self.policies: dict[int, pb.ResolvedPolicy] = {}
        self.revision = 0

    async def until(self, ident: int, want: Prefixes, timeout: float) -> float:
        start = time.monotonic()

        async def read() -> None:
            while ident not in self.policies or prefixes(self.policies[ident]) != want:
                ev = await self.events.__anext__()
                if ev.kind == pb.EVENT_KIND_UPSERT:
                    self.policies[ev.identity] = ev.policy
                elif ev.kind == pb.EVENT_KIND_SYNCED:
                    self.revision = ev.revision

        await asyncio.wait_for(read(), timeout)
        return time.monotonic() - start

    async def synced(self) -> None:
        """Reads to the end of the current batch."""
        while True:
            ev = await asyncio.wait_for(self.events.__anext__(), 5)
            if ev.kind == pb.EVENT_KIND_UPSERT:
                self.policies[ev.identity] = ev.policy
            elif ev.kind == pb.EVENT_KIND_SYNCED:
                self.revision = ev.revision
                return


async def test_prefix_entries_follow_the_backends(etcd: EtcdServer, spawn: Spawn) -> None:
    lb_port = free_port()
    policy = spawn(
        "policy", "--etcd-endpoints", etcd.endpoint, "--lb-address", f"127.0.0.1:{lb_port}"
    )  # ready (spawn waits for SERVING) with no lb there yet
    operator = policy.aio_channel()
    endpoint = policy.aio_channel(pki.service("endpoint"))
    s, ep = pbg.PolicyServiceStub(operator), pbg.PolicyServiceStub(endpoint)
    lb_channel: grpc.Channel | None = None
    try:
        await s.PutRules(pb.PutRulesRequest(document=RULES))
        web = (
            await ep.AllocateIdentity(
                pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node="n1")
            )
        ).identity.id
        report = (
            await ep.AllocateIdentity(
                pb.AllocateIdentityRequest(labels=pod_labels("shop", app="report"), node="n1")
            )
        ).identity.id

        async def resolved(ident: int) -> Prefixes:
            return prefixes(await s.ResolvePolicy(pb.ResolvePolicyRequest(identity=ident)))

        # No lb: enforced, nothing allowed (closed).
        first = await s.ResolvePolicy(pb.ResolvePolicyRequest(identity=web))
        assert first.egress_enforced
        assert not first.prefix_entries
        assert not any(e.direction == pb.DIRECTION_EGRESS for e in first.entries)

        lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, port=lb_port)
        lb_channel = lb.channel()
        lbs = lb_pb2_grpc.LoadBalancerServiceStub(lb_channel)
        db = service("shop/db", "10.96.0.20", 5432, [("10.0.1.5", 5432)], labels={"tier": "data"})
        lbs.UpsertService(lb_pb2.UpsertServiceRequest(service=db))
        pg = ((5432, 0, 6),)
        every = ((0, 0, 0),)
        # The stream to lb connects when lb comes (reconnect backoff).
        await until(lambda: resolved(web), {"10.0.1.5/32": pg}, 15.0)
        await until(lambda: resolved(report), {"10.0.1.5/32": every}, 2.0)

        watch = Watch(s)
        await watch.until(web, {"10.0.1.5/32": pg}, 5.0)
        await watch.synced()

        # A backend replaced: the new address, not the old, within a second.
        db = service("shop/db", "10.96.0.20", 5432, [("10.0.1.6", 5432)], labels={"tier": "data"})
        lbs.UpsertService(lb_pb2.UpsertServiceRequest(service=db))
        assert await watch.until(web, {"10.0.1.6/32": pg}, 5.0) < 1.0
        assert await resolved(web) == {"10.0.1.6/32": pg}
        await watch.synced()
        since = watch.revision
        watch.call.cancel()

        # Changed while the client is away (no etcd revision of policy's
        # own): a resumed stream still sends the new policy.
        db = service(
            "shop/db",
            "10.96.0.20",
            5432,
            [("10.0.1.7", 5432), ("10.0.1.8", 5432)],
            labels={"tier": "data"},
        )
        lbs.UpsertService(lb_pb2.UpsertServiceRequest(service=db))
        both = {"10.0.1.7/32": pg, "10.0.1.8/32": pg}
        await until(lambda: resolved(web), both, 2.0)
        resumed = Watch(s, since)
        await resumed.until(web, both, 5.0)
        resumed.call.cancel()

        # Labels changed: the selector no longer matches.
        db.labels["tier"] = "cache"
        lbs.UpsertService(lb_pb2.UpsertServiceRequest(service=db))
        await until(lambda: resolved(report), {}, 2.0)

        # Deleted: nothing (never any peer).
        lbs.DeleteService(lb_pb2.DeleteServiceRequest(name="shop/db"))
        await until(lambda: resolved(web), {}, 2.0)
        final = await s.ResolvePolicy(pb.ResolvePolicyRequest(identity=web))
        assert not any(e.direction == pb.DIRECTION_EGRESS for e in final.entries)
    finally:
        if lb_channel is not None:
            lb_channel.close()
        await operator.close()
        await endpoint.close()


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (RULES.replace("  egress:", "  egressDeny:", 1), "spec.egressDeny[0].toServices"),
        (
            RULES.replace("[{k8sService: {serviceName: db}}]", "[{k8sService: {}}]"),
            "spec.egress[0].toServices[0].k8sService.serviceName",
        ),
        (
            RULES.replace("{k8sService: {serviceName: db}}", "{}"),
            "spec.egress[0].toServices[0]",
        ),
    ],
)
async def test_errors_name_the_field_and_store_nothing(
    etcd: EtcdServer, spawn: Spawn, document: str, field: str
) -> None:
    policy = spawn("policy", "--etcd-endpoints", etcd.endpoint, "--lb-address", "")
    channel = policy.aio_channel()
    s = pbg.PolicyServiceStub(channel)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.PutRules(pb.PutRulesRequest(document=document))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (info.value.details() or "")
        assert not (await s.ListRules(pb.ListRulesRequest())).rules
    finally:
        await channel.close()
