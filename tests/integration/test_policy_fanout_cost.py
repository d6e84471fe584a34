"""What one change costs policy's watch streams, through a real policy
process with many streams open (docs/SCALE.md, "What breaks first"): an
ipcache change is built into a message once for every WatchIPCache stream,
an identity's new policy once for every node's WatchPolicy that holds it
(flagella_policy_watch_messages_built), and revisions that touch nothing of
a node reach its stream as a few SYNCEDs, not one per revision, yet
promptly (a datapath waiting for such a revision learns that it has it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from harness.etcd import EtcdServer
from harness.metrics import value
from harness.procs import ServiceProcess
from policy_client import pod_labels, stub, watch_ipcache, watch_policy

from flagella.api.policy.v1 import policy_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Spawn = Callable[..., ServiceProcess]

NODES = 30

RULE = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "%d", protocol: TCP}]}]
"""


def built(proc: ServiceProcess, stream: str) -> float:
    return value(proc.scrape(), "flagella_policy_watch_messages_built_total", stream=stream)


async def test_one_change_is_built_once_for_every_stream(etcd: EtcdServer, spawn: Spawn) -> None:
    # 31 WatchPolicy streams at 20 quiet SYNCEDs a second: 1.55 s apart.
    proc = spawn("policy", "--etcd-endpoints", etcd.endpoint, "--watch-quiet-sync-rate", "20")
    ch, s = stub(proc.address)
    streams = []
    try:
        await s.PutRules(pb.PutRulesRequest(document=RULE % 80))
        nodes = [f"n{i}" for i in range(NODES)]
        for node in nodes:
            await s.AllocateIdentity(
                pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node=node)
            )
        # the rule's peer (its entries name it), on a node of its own
        await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("shop", app="client"), node="peer")
        )
        quiet = await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("shop", app="db"), node="quiet")
        )
        ipcaches = [watch_ipcache(s) for _ in nodes]
        policies = [watch_policy(s, node) for node in nodes]
        quiet_stream = watch_policy(s, "quiet")
        streams = [*ipcaches, *policies, quiet_stream]
        await asyncio.gather(*(st.until_synced() for st in streams))
        web = next(iter(policies[0].state))
        assert all(set(p.state) == {web} for p in policies)
        assert all(any(e[1] == 80 for e in p.state[web][2]) for p in policies)
        assert set(quiet_stream.state) == {quiet.identity.id}

        # An ipcache entry: one message, whatever the number of streams.
        before = built(proc, "ipcache")
        resp = await s.UpsertIPCache(
            pb.UpsertIPCacheRequest(
                entry=pb.IPCacheEntry(
                    prefix="10.0.0.9", identity=web, node="n0", host_ip="192.0.2.1"
                )
            )
        )
        rev = resp.entry.revision
        await asyncio.gather(*(st.until_synced(rev) for st in ipcaches))
        assert all(st.state["10.0.0.9"][0] == web for st in ipcaches)
        assert built(proc, "ipcache") - before == 1

        # A burst of entries to a stream that batches: a few messages, in
        # which each entry is built once (shared with the other streams).
        batching = watch_ipcache(s, batch_events=True)
        streams.append(batching)
        await batching.until_synced()
        events = batching.events
        before = built(proc, "ipcache")
        upserts = await asyncio.gather(
            *(
                s.UpsertIPCache(
                    pb.UpsertIPCacheRequest(
                        entry=pb.IPCacheEntry(
                            prefix=f"10.0.1.{i}", identity=web, node="n1", host_ip="192.0.2.2"
                        )
                    )
                )
                for i in range(NODES)
            )
        )
        rev = max(u.entry.revision for u in upserts)
        await asyncio.gather(batching.until_synced(rev), *(st.until_synced(rev) for st in ipcaches))
        assert all(f"10.0.1.{i}" in st.state for st in (batching, *ipcaches) for i in range(NODES))
        assert batching.events - events < NODES, batching.kinds[-NODES:]
        assert pb.EVENT_KIND_BATCH in batching.kinds
        assert built(proc, "ipcache") - before == NODES

        # web's policy changes: one message for the 30 nodes holding web;
        # the node that holds only db is sent no policy.
        before = built(proc, "policy")
        quiet_events = quiet_stream.events
        put = await s.PutRules(pb.PutRulesRequest(document=RULE % 8080))
        await asyncio.gather(*(st.until_synced(put.revision) for st in policies))
        assert all(any(e[1] == 8080 for e in p.state[web][2]) for p in policies)
        assert built(proc, "policy") - before == 1
        # ...but it learns the revision promptly, as a SYNCED.
        await quiet_stream.until_synced(put.revision, timeout=5)
        assert set(quiet_stream.kinds[quiet_events:]) == {pb.EVENT_KIND_SYNCED}

        # A burst of revisions that touch nothing of the quiet node: a few
        # SYNCEDs (one at once, then one per quiet interval), not one per
        # revision.
        quiet_events = len(quiet_stream.kinds)
        burst = await asyncio.gather(
            *(
                s.AllocateIdentity(
                    pb.AllocateIdentityRequest(
                        labels=pod_labels("shop", app="web"), node=node, owner=f"pod{i}"
                    )
                )
                for i, node in enumerate(nodes)
            )
        )
        last = max(r.identity.revision for r in burst)
        await quiet_stream.until_synced(last, timeout=10)
        synceds = quiet_stream.kinds[quiet_events:]
        assert set(synceds) == {pb.EVENT_KIND_SYNCED}
        assert len(synceds) <= 4, synceds

        # Once quiet again, one such revision is announced at once.
        await asyncio.sleep(2)
        loop = asyncio.get_running_loop()
        other = await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node="n1", owner="x")
        )
        started = loop.time()
        await quiet_stream.until_synced(other.identity.revision, timeout=10)
        assert loop.time() - started < 1.0
    finally:
        for st in streams:
            st.cancel()
        await ch.close()
