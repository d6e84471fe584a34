"""Runtime configuration through a real policy process (real etcd, mutual
TLS, per-RPC authorization): GetConfig lists every option with its default
and mutability; PatchConfig sets cluster values and node overrides, checks
revisions, and refuses an unknown or immutable option or an invalid value,
naming it, with nothing changed; WatchConfig gives a node the cluster's
values and its own overrides, live; the CLI does the same."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import cli

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg
from flagella.common import pki

pytestmark = pytest.mark.integration


def values(cfg: pb.RuntimeConfig) -> dict[str, tuple[str, str]]:
    return {o.name: (o.value, o.source) for o in cfg.options if o.mutable}


async def test_get_patch_watch_config(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    policy = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    channels = [policy.aio_channel(), policy.aio_channel(pki.node("n1"))]
    op, n1 = (pbg.PolicyServiceStub(c) for c in channels)
    try:
        first = await op.GetConfig(pb.GetConfigRequest())
        by = {o.name: o for o in first.options}
        assert by["policy-audit-mode"].default == "false"
        assert by["policy-audit-mode"].mutable
        assert list(by["policy-enforcement"].allowed) == ["default", "always", "never"]
        assert not by["routing-mode"].mutable
        assert values(first)["policy-audit-mode"] == ("false", "default")
        assert first.cluster_revision == 0

        # A node follows its values: the defaults (nothing set) first.
        stream = n1.WatchConfig(pb.WatchConfigRequest(node="n1"))
        events: asyncio.Queue[pb.ConfigEvent] = asyncio.Queue()

        async def read() -> None:
            async for ev in stream:
                await events.put(ev)

        reader = asyncio.create_task(read())

        async def next_upsert() -> pb.ConfigEvent:
            while True:
                ev = await asyncio.wait_for(events.get(), 10)
                if ev.kind == pb.EVENT_KIND_UPSERT:
                    return ev

        cluster = await op.PatchConfig(
            pb.PatchConfigRequest(set={"policy-audit-mode": "true", "debug": "true"})
        )
        assert values(cluster)["policy-audit-mode"] == ("true", "cluster")
        ev = await next_upsert()
        assert (ev.scope, dict(ev.values)) == ("", {"policy-audit-mode": "true", "debug": "true"})

        node = await op.PatchConfig(
            pb.PatchConfigRequest(node="n1", set={"policy-audit-mode": "false"})
        )
        assert values(node)["policy-audit-mode"] == ("false", "node")
        assert values(node)["debug"] == ("true", "cluster")
        assert dict(node.node_overrides) == {"policy-audit-mode": "false"}
        ev = await next_upsert()
        assert (ev.scope, dict(ev.values)) == ("n1", {"policy-audit-mode": "false"})
        # Another node's override is not n1's business.
        await op.PatchConfig(pb.PatchConfigRequest(node="n2", set={"debug": "false"}))

        # Refused, naming the option; nothing changes.
        for request, field in [
            (pb.PatchConfigRequest(set={"policy-audit-mode": "maybe"}), "set[policy-audit-mode]"),
            (pb.PatchConfigRequest(set={"routing-mode": "tunnel"}), "set[routing-mode]"),
            (pb.PatchConfigRequest(set={"no-such-option": "1"}), "set[no-such-option]"),
            (pb.PatchConfigRequest(set={"debug": "false"}, reset=["bpf-root"]), "reset[0]"),
            (pb.PatchConfigRequest(node="bad name", set={"debug": "true"}), "node"),
            (pb.PatchConfigRequest(), "set"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await op.PatchConfig(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert (err.value.details() or "").startswith(f"{field}:"), err.value.details()
        # A stale revision: ABORTED, nothing changes.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await op.PatchConfig(
                pb.PatchConfigRequest(
                    set={"debug": "false"}, expected_revision=cluster.cluster_revision - 1
                )
            )
        assert err.value.code() == grpc.StatusCode.ABORTED
        after = await op.GetConfig(pb.GetConfigRequest(node="n1"))
        assert dict(after.cluster) == {"policy-audit-mode": "true", "debug": "true"}
        assert after.cluster_revision == cluster.cluster_revision
        assert dict(after.node_overrides) == {"policy-audit-mode": "false"}

        # A node only patches nothing and follows only itself.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await n1.PatchConfig(pb.PatchConfigRequest(set={"debug": "false"}))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in n1.WatchConfig(pb.WatchConfigRequest(node="n2")):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

        # The CLI: a reset with the revision check, then get.
        cli(
            policy,
            "config",
            "patch",
            "--node",
            "n1",
            "--reset",
            "policy-audit-mode",
            "--expected-revision",
            str(after.node_revision),
        )
        ev = await asyncio.wait_for(events.get(), 10)
        while ev.kind != pb.EVENT_KIND_DELETE:
            ev = await asyncio.wait_for(events.get(), 10)
        assert ev.scope == "n1"
        shown = json.loads(cli(policy, "-o", "json", "config", "get", "--node", "n1"))
        got = {o["name"]: (o.get("value", ""), o.get("source", "")) for o in shown["options"]}
        assert got["policy-audit-mode"] == ("true", "cluster")
        assert "node_overrides" not in shown
        reader.cancel()
    finally:
        for c in channels:
            await c.close()
