"""The ipam service's API against real etcd and real ipam processes:
node registry on leases, cluster-pool CIDRs, allocation, expiry, commit,
release, reconcile, status, and every error (code and the field named)."""

from __future__ import annotations

import asyncio
import ipaddress
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.metrics import samples
from harness.procs import ServiceProcess
from ipam_support import V4, V6, Ipam, expect_error, ipam_args, owner, spawn_ipam, wait_for

from flagella.api.ipam.v1 import ipam_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Code = grpc.StatusCode
CLUSTER = ("--cluster-cidr", "10.10.0.0/16", "--cluster-cidr", "fd00:10::/104")
MASKS = ("--node-mask-size-v4", "24", "--node-mask-size-v6", "120")
# Four /28 blocks of 13 usable addresses each, IPv4 only.
SMALL = ("--cluster-cidr", "10.30.0.0/26", "--node-mask-size-v4", "28")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, Ipam]]:
    """One etcd and one dual-stack ipam shared by the tests of this module
    (each test uses its own node names)."""
    base = tmp_path_factory.mktemp("ipam-api")
    etcd = EtcdServer(base / "etcd").start()
    proc = ServiceProcess("ipam", ipam_args(etcd, *CLUSTER, *MASKS), log_dir=base, insecure=True)
    try:
        proc.start().wait_serving()
        client = Ipam(proc.address)
        yield etcd, client
        client.close()
    finally:
        proc.stop()
        etcd.cleanup()


@pytest.fixture
def ipam(env: tuple[EtcdServer, Ipam]) -> Ipam:
    return env[1]


def net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


# --- node registry ---


def test_register_assigns_one_block_per_family_and_get_list_agree(ipam: Ipam) -> None:
    n1 = ipam.register(
        "reg-1",
        addresses=[pb.NodeAddress(type=pb.NodeAddress.TYPE_INTERNAL_IP, ip="192.168.0.11")],
        datapath_address="127.0.0.1:7001",
        labels={"zone": "a"},
    )
    n2 = ipam.register("reg-2", datapath_address="127.0.0.1:7002")
    for n in (n1, n2):
        assert len(n.pod_cidrs) == 2
        v4, v6 = (net(c) for c in n.pod_cidrs)
        assert v4.prefixlen == 24
        assert v4.subnet_of(net("10.10.0.0/16"))
        assert v6.prefixlen == 120
        assert v6.subnet_of(net("fd00:10::/104"))
        assert n.lease_ttl.seconds == 30
    assert not set(n1.pod_cidrs) & set(n2.pod_cidrs)

    got = ipam.stub.GetNode(pb.GetNodeRequest(name="reg-1"))
    assert got.datapath_address == "127.0.0.1:7001"
    assert got.addresses[0].ip == "192.168.0.11"
    assert dict(got.labels) == {"zone": "a"}
    assert list(got.pod_cidrs) == list(n1.pod_cidrs)
    listed = ipam.nodes()
    assert listed["reg-2"].pod_cidrs == n2.pod_cidrs

    again = ipam.register("reg-1", datapath_address="127.0.0.1:7011")
    assert list(again.pod_cidrs) == list(n1.pod_cidrs)
    assert again.revision > n1.revision
    assert ipam.stub.GetNode(pb.GetNodeRequest(name="reg-1")).datapath_address == "127.0.0.1:7011"


def test_concurrent_registrations_never_share_a_block(
    env: tuple[EtcdServer, Ipam], spawn: Callable[..., ServiceProcess]
) -> None:
    etcd, first = env
    _, second = spawn_ipam(spawn, etcd, *CLUSTER, *MASKS)
    results: dict[str, pb.Node] = {}
    lock = threading.Lock()

    def register(i: int) -> None:
        client = first if i % 2 else second
        node = client.register(f"race-{i}")
        with lock:
            results[node.name] = node

    threads = [threading.Thread(target=register, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 24
    ids = [n.id for n in results.values()]
    assert 0 not in ids
    assert len(set(ids)) == 24, "two nodes got the same node id"
    blocks = [c for n in ipam_nodes_cidrs(first).values() for c in n]
    assert len(blocks) == len(set(blocks)), "two nodes got the same block"
    nets = [net(b) for b in blocks]
    for i, a in enumerate(nets):
        for b in nets[i + 1 :]:
            assert not a.overlaps(b)
    second.close()


def etcd_txns(etcd: EtcdServer, method: str = "Txn") -> float:
    with urllib.request.urlopen(etcd.metrics_url, timeout=10) as resp:
        scraped = samples(resp.read().decode())
    return sum(
        v
        for (name, labels), v in scraped.items()
        if name == "grpc_server_started_total" and ("grpc_method", method) in labels
    )


def test_a_renewal_takes_the_lease_from_the_node_table(env: tuple[EtcdServer, Ipam]) -> None:
    """RenewNode refreshes the lease its replica's node table holds: no
    read of etcd per renewal (a node renews every 10 s); a registration
    with a new lease is renewed on the new one."""
    etcd, ipam = env
    ipam.register("renew-a")

    def renew_when_seen() -> bool:
        try:
            ipam.stub.RenewNode(pb.RenewNodeRequest(name="renew-a"), timeout=10)
        except grpc.RpcError:
            return False
        return True

    wait_for(renew_when_seen)
    reads = etcd_txns(etcd, "Range") + etcd_txns(etcd)
    for _ in range(20):
        ipam.stub.RenewNode(pb.RenewNodeRequest(name="renew-a"), timeout=10)
    assert etcd_txns(etcd, "Range") + etcd_txns(etcd) == reads
    ipam.register("renew-a")  # a new lease (the old one revoked)
    for _ in range(3):
        assert (
            ipam.stub.RenewNode(pb.RenewNodeRequest(name="renew-a"), timeout=10).remaining.seconds
            > 0
        )


def test_a_join_storm_on_one_replica_carves_without_running_out_of_attempts(
    env: tuple[EtcdServer, Ipam],
) -> None:
    """96 nodes registering at the same moment through one replica (a
    restart storm): each registration in flight claims its block and id, so
    the others pick different ones instead of all racing for the lowest
    free (a transaction lost per node already in), and no registration
    reads every node id."""
    etcd, ipam = env
    txns = etcd_txns(etcd)
    results: dict[str, pb.Node] = {}
    errors: list[grpc.RpcError] = []
    lock = threading.Lock()
    start = threading.Event()

    def register(i: int) -> None:
        start.wait()
        try:
            node = ipam.register(f"storm-{i}")
        except grpc.RpcError as exc:
            with lock:
                errors.append(exc)
            return
        with lock:
            results[node.name] = node

    threads = [threading.Thread(target=register, args=(i,)) for i in range(96)]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join()
    assert not errors, [e.details() for e in errors[:3]]
    assert len({n.id for n in results.values()}) == 96
    v4 = [c for n in results.values() for c in n.pod_cidrs if ":" not in c]
    assert len(set(v4)) == 96
    # Per node: its state read, its write (and a lease), few conflicts.
    used = etcd_txns(etcd) - txns
    print(f"etcd transactions for 96 registrations: {used:.0f}")
    assert used < 96 * 3
    for i in range(96):
        ipam.stub.DeregisterNode(pb.DeregisterNodeRequest(name=f"storm-{i}", release_cidrs=True))


def node_ids(ipam: Ipam) -> dict[str, tuple[int, list[str]]]:
    ids = ipam.stub.GetNodeIds(pb.GetNodeIdsRequest(), timeout=10).ids
    return {x.node: (x.id, list(x.ips)) for x in ids}


def test_node_ids_are_kept_across_registrations_and_freed_with_the_node(ipam: Ipam) -> None:
    internal = pb.NodeAddress(type=pb.NodeAddress.TYPE_INTERNAL_IP, ip="192.0.2.41")
    a = ipam.register("ids-a", addresses=[internal])
    b = ipam.register("ids-b")
    assert a.id > 0
    assert b.id > 0
    assert a.id != b.id
    assert ipam.stub.GetNode(pb.GetNodeRequest(name="ids-a")).id == a.id
    assert ipam.register("ids-a", addresses=[internal]).id == a.id  # a restart
    assert node_ids(ipam)["ids-a"] == (a.id, ["192.0.2.41"])
    # Gone without releasing its CIDRs (it may come back): its id is kept.
    ipam.stub.DeregisterNode(pb.DeregisterNodeRequest(name="ids-a"))
    assert node_ids(ipam)["ids-a"] == (a.id, [])
    c = ipam.register("ids-c")
    assert c.id not in (a.id, b.id)
    assert ipam.register("ids-a").id == a.id
    # Released for good: the id is free again, and the lowest free is next.
    ipam.stub.DeregisterNode(pb.DeregisterNodeRequest(name="ids-a", release_cidrs=True))
    held = node_ids(ipam)
    assert "ids-a" not in held
    lowest = min(set(range(1, 65536)) - {i for i, _ in held.values()})
    assert ipam.register("ids-d").id == lowest


def ipam_nodes_cidrs(ipam: Ipam) -> dict[str, list[str]]:
    status = ipam.stub.GetStatus(pb.GetStatusRequest())
    out: dict[str, list[str]] = {}
    for p in status.pools:
        out.setdefault(p.node, []).append(p.cidr)
    return out


def test_lease_expiry_removes_the_node_but_keeps_cidrs_and_allocations(ipam: Ipam) -> None:
    ttl = pb.RegisterNodeRequest().lease_ttl
    ttl.seconds = 2
    node = ipam.register("lease-1", lease_ttl=ttl)
    assert node.lease_ttl.seconds == 2
    got = ipam.allocate("lease-1", "lease-c1")
    remaining = ipam.stub.RenewNode(pb.RenewNodeRequest(name="lease-1")).remaining
    assert 0 < remaining.seconds <= 2

    def gone() -> bool:
        try:
            ipam.stub.GetNode(pb.GetNodeRequest(name="lease-1"))
        except grpc.RpcError as exc:
            return exc.code() == Code.NOT_FOUND
        return False

    wait_for(gone, timeout=15)
    assert "lease-1" not in ipam.nodes()
    expect_error(
        Code.NOT_FOUND, "name", lambda: ipam.stub.RenewNode(pb.RenewNodeRequest(name="lease-1"))
    )
    # Allocations stay; the node gets its CIDRs back when it registers again.
    assert {a.ip for a in ipam.allocations("lease-1")} == {a.ip for a in got}
    assert ipam.allocate("lease-1", "lease-c1") == got
    back = ipam.register("lease-1")
    assert list(back.pod_cidrs) == list(node.pod_cidrs)


def follow_nodes(
    stream: Any, state: dict[str, pb.Node], until: int, *, deltas: bool = False
) -> tuple[int, int]:
    """Apply WatchNodes events (a KIND_BATCH as its events) until a SYNCED
    reaches until, or with deltas (no SYNCED follows them before the idle
    heartbeat) a message's events do: (the revision, KIND_BATCH messages
    seen)."""
    batches = 0
    for ev in stream:
        kinds = (pb.NodeEvent.KIND_UPSERT, pb.NodeEvent.KIND_DELETE, pb.NodeEvent.KIND_BATCH)
        reached = deltas and ev.kind in kinds and ev.revision >= until
        events = list(ev.events) if ev.kind == pb.NodeEvent.KIND_BATCH else [ev]
        if ev.kind == pb.NodeEvent.KIND_BATCH:
            batches += 1
            assert len(events) > 1
            assert ev.revision == events[-1].revision
        for e in events:
            if e.kind == pb.NodeEvent.KIND_RESET:
                state.clear()
            elif e.kind == pb.NodeEvent.KIND_UPSERT:
                state[e.node.name] = e.node
            elif e.kind == pb.NodeEvent.KIND_DELETE:
                state.pop(e.node.name, None)
            elif e.kind == pb.NodeEvent.KIND_SYNCED and e.revision >= until:
                return e.revision, batches
        if reached:
            return ev.revision, batches
    raise AssertionError("stream ended")


def test_watch_nodes_batched_says_what_the_one_by_one_stream_says(ipam: Ipam) -> None:
    """batch_events: a snapshot's and a batch's events come several to a
    KIND_BATCH message; the watcher ends where the one-by-one one does."""
    for i in range(6):
        ipam.register(f"wb-{i}")
    head = ipam.stub.ListNodes(pb.ListNodesRequest(), timeout=10).revision
    batched = ipam.stub.WatchNodes(pb.WatchNodesRequest(batch_events=True), timeout=30)
    plain = ipam.stub.WatchNodes(pb.WatchNodesRequest(), timeout=30)
    got: dict[str, pb.Node] = {}
    want: dict[str, pb.Node] = {}
    _, batches = follow_nodes(batched, got, head)
    _, plain_batches = follow_nodes(plain, want, head)
    assert batches >= 1
    assert plain_batches == 0
    assert got == want
    assert {f"wb-{i}" for i in range(6)} <= set(got)
    ipam.stub.DeregisterNode(pb.DeregisterNodeRequest(name="wb-0"))
    ipam.register("wb-6")
    head = ipam.stub.ListNodes(pb.ListNodesRequest(), timeout=10).revision
    follow_nodes(batched, got, head, deltas=True)
    follow_nodes(plain, want, head, deltas=True)
    assert got == want
    assert "wb-0" not in got
    assert "wb-6" in got
    batched.cancel()
    plain.cancel()


def test_watch_nodes_snapshot_then_deltas_and_resume(ipam: Ipam) -> None:
    ipam.register("watch-1")
    stream = ipam.stub.WatchNodes(pb.WatchNodesRequest(since_revision=0), timeout=30)
    first = next(stream)
    assert first.kind == pb.NodeEvent.KIND_RESET
    snapshot: dict[str, pb.Node] = {}
    for ev in stream:
        if ev.kind == pb.NodeEvent.KIND_SYNCED:
            synced_at = ev.revision
            break
        assert ev.kind == pb.NodeEvent.KIND_UPSERT
        snapshot[ev.node.name] = ev.node
    assert "watch-1" in snapshot
    assert synced_at >= max(n.revision for n in snapshot.values())

    w2 = ipam.register("watch-2", datapath_address="127.0.0.1:7100")
    ev = next(stream)
    assert (ev.kind, ev.node.name, ev.node.datapath_address) == (
        pb.NodeEvent.KIND_UPSERT,
        "watch-2",
        "127.0.0.1:7100",
    )
    assert ev.revision == w2.revision
    assert ev.node.pod_cidrs == w2.pod_cidrs
    ipam.stub.DeregisterNode(pb.DeregisterNodeRequest(name="watch-2"))
    ev = next(stream)
    assert (ev.kind, ev.node.name) == (pb.NodeEvent.KIND_DELETE, "watch-2")
    resume_from = ev.revision
    stream.cancel()

    ipam.register("watch-3")
    resumed = ipam.stub.WatchNodes(pb.WatchNodesRequest(since_revision=resume_from), timeout=30)
    ev = next(resumed)
    assert (ev.kind, ev.revision) == (pb.NodeEvent.KIND_SYNCED, resume_from)
    ev = next(resumed)
    assert (ev.kind, ev.node.name) == (pb.NodeEvent.KIND_UPSERT, "watch-3")
    resumed.cancel()


def test_watch_nodes_resyncs_when_the_resume_revision_was_compacted(
    env: tuple[EtcdServer, Ipam],
) -> None:
    etcd, ipam = env
    ipam.register("compact-1")
    old = ipam.revision()
    ipam.register("compact-2")
    ipam.register("compact-3")  # etcd keeps the compaction revision: go past old + 1

    async def compact() -> None:
        client = etcd.client()
        try:
            await client.client.compact(ipam.revision())
        finally:
            await client.close()

    asyncio.run(compact())
    stream = ipam.stub.WatchNodes(pb.WatchNodesRequest(since_revision=old), timeout=30)
    kinds = []
    names = set()
    for ev in stream:
        kinds.append(ev.kind)
        names.add(ev.node.name)
        if ev.kind == pb.NodeEvent.KIND_SYNCED and len(kinds) > 1:
            break
    stream.cancel()
    # SYNCED at the asked revision, then (it is gone) a full snapshot.
    assert kinds[:2] == [pb.NodeEvent.KIND_SYNCED, pb.NodeEvent.KIND_RESET]
    assert set(kinds[2:-1]) == {pb.NodeEvent.KIND_UPSERT}
    assert {"compact-1", "compact-2", "compact-3"} <= names


def test_deregister_release_cidrs_needs_an_empty_node(ipam: Ipam) -> None:
    node = ipam.register("dereg-1")
    ipam.allocate("dereg-1", "dereg-c1")
    rev = ipam.revision()
    expect_error(
        Code.FAILED_PRECONDITION,
        "release_cidrs",
        lambda: ipam.stub.DeregisterNode(
            pb.DeregisterNodeRequest(name="dereg-1", release_cidrs=True)
        ),
    )
    assert ipam.revision() == rev
    assert "dereg-1" in ipam.nodes()
    ipam.release_owner("dereg-1", "dereg-c1")
    ipam.stub.DeregisterNode(pb.DeregisterNodeRequest(name="dereg-1", release_cidrs=True))
    assert "dereg-1" not in ipam.nodes()
    expect_error(Code.NOT_FOUND, "node", lambda: ipam.allocate("dereg-1", "dereg-c2"))
    assert "dereg-1" not in ipam_nodes_cidrs(ipam)
    taken = {c for cs in ipam_nodes_cidrs(ipam).values() for c in cs}
    assert not set(node.pod_cidrs) & taken


# --- allocation ---


def test_allocate_dual_stack_is_idempotent_per_owner(ipam: Ipam) -> None:
    node = ipam.register("alloc-1")
    v4net, v6net = (net(c) for c in node.pod_cidrs)
    got = ipam.allocate("alloc-1", "c-dual")
    assert [a.family for a in got] == [V4, V6]
    assert ipaddress.ip_address(got[0].ip) in v4net
    assert ipaddress.ip_address(got[1].ip) in v6net
    assert all(a.owner.container_id == "c-dual" and a.node == "alloc-1" for a in got)
    assert all(not a.HasField("expires_at") for a in got)
    assert ipam.allocate("alloc-1", "c-dual") == got
    # Another interface of the same container is another owner.
    eth1 = ipam.allocate("alloc-1", "c-dual", ifname="eth1", families=[V4])
    assert eth1[0].ip != got[0].ip
    # An owner that holds IPv4 asks for both: it keeps its IPv4, gains IPv6.
    only4 = ipam.allocate("alloc-1", "c-grow", families=[V4])
    both = ipam.allocate("alloc-1", "c-grow")
    assert both[0] == only4[0]
    assert both[1].family == V6

    listed = {(a.ip, a.owner.container_id, a.owner.ifname) for a in ipam.allocations("alloc-1")}
    assert (got[0].ip, "c-dual", "eth0") in listed
    assert (eth1[0].ip, "c-dual", "eth1") in listed
    assert {a.family for a in ipam.allocations("alloc-1", V6)} == {V6}


def test_allocate_ip_given_address(ipam: Ipam) -> None:
    node = ipam.register("given-1")
    v4net = net(node.pod_cidrs[0])
    ip = str(v4net.network_address + 10)
    a = ipam.allocate_ip("given-1", ip, "c-given")
    assert (a.ip, a.cidr, a.family) == (ip, str(v4net), V4)
    assert ipam.allocate_ip("given-1", ip, "c-given") == a
    expect_error(Code.ALREADY_EXISTS, "ip", lambda: ipam.allocate_ip("given-1", ip, "c-other"))
    other = str(v4net.network_address + 11)
    expect_error(
        Code.ALREADY_EXISTS, "owner", lambda: ipam.allocate_ip("given-1", other, "c-given")
    )
    # Allocate returns the given IP to its owner.
    assert ipam.allocate("given-1", "c-given", families=[V4])[0].ip == ip


def test_network_gateway_broadcast_never_handed_out_and_exhaustion_is_exact(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    _, ipam = spawn_ipam(spawn, etcd, *SMALL)
    node = ipam.register("small-1")
    block = net(node.pod_cidrs[0])
    assert block.prefixlen == 28
    assert len(node.pod_cidrs) == 1
    for reserved in (block.network_address, block.network_address + 1, block.broadcast_address):
        expect_error(
            Code.INVALID_ARGUMENT, "ip", lambda r=reserved: ipam.allocate_ip("small-1", str(r), "x")
        )
    ips = [ipam.allocate("small-1", f"c{i}")[0].ip for i in range(13)]
    assert len(set(ips)) == 13
    # .0 network, .1 gateway, .15 broadcast: the 13 others.
    assert {ipaddress.ip_address(ip) for ip in ips} == set(list(block.hosts())[1:])
    rev = ipam.revision()
    msg = expect_error(Code.RESOURCE_EXHAUSTED, "node", lambda: ipam.allocate("small-1", "c13"))
    assert "13 of 13" in msg
    assert ipam.revision() == rev
    # Release then allocate reuses the space.
    freed = ipam.release_owner("small-1", "c5")
    assert [a.ip for a in freed] == [ips[5]]
    assert ipam.allocate("small-1", "c13")[0].ip == ips[5]
    # An owner that already holds its IP gets it back even from a full pool.
    assert ipam.allocate("small-1", "c3")[0].ip == ips[3]
    # A family the cluster does not have.
    expect_error(
        Code.INVALID_ARGUMENT, "families[0]", lambda: ipam.allocate("small-1", "c99", [V6])
    )
    # Blocks run out too: four /28 in a /26.
    for i in range(2, 5):
        ipam.register(f"small-{i}")
    expect_error(Code.RESOURCE_EXHAUSTED, "name", lambda: ipam.register("small-5"))
    assert "small-5" not in ipam.nodes()
    # A node deregistered with release_cidrs frees its block for the next.
    small4 = ipam.nodes()["small-4"].pod_cidrs
    ipam.stub.DeregisterNode(pb.DeregisterNodeRequest(name="small-4", release_cidrs=True))
    assert ipam.register("small-5").pod_cidrs == small4


def test_expired_reservations_are_freed_and_committed_ones_kept(ipam: Ipam) -> None:
    ipam.register("exp-1")
    doomed = ipam.allocate("exp-1", "c-doomed", expiration=1.0)
    kept = ipam.allocate("exp-1", "c-kept", expiration=1.0)
    assert all(a.HasField("expires_at") for a in doomed + kept)
    committed = ipam.commit("exp-1", "c-kept")
    assert [a.ip for a in committed] == [a.ip for a in kept]
    assert all(not a.HasField("expires_at") for a in committed)
    assert ipam.commit("exp-1", "c-kept") == committed  # idempotent

    def freed() -> bool:
        owners = {a.owner.container_id for a in ipam.allocations("exp-1")}
        return "c-doomed" not in owners

    wait_for(freed, timeout=10)
    assert {a.ip for a in ipam.allocations("exp-1")} == {a.ip for a in kept}
    expect_error(Code.NOT_FOUND, "owner", lambda: ipam.commit("exp-1", "c-doomed"))


def test_release_by_ip_needs_force_while_the_owner_holds_it(ipam: Ipam) -> None:
    ipam.register("rel-1")
    held = ipam.allocate("rel-1", "c-held", families=[V4])[0]
    rev = ipam.revision()
    msg = expect_error(Code.FAILED_PRECONDITION, "ip", lambda: ipam.release_ip("rel-1", held.ip))
    assert "force" in msg
    assert ipam.revision() == rev
    released = ipam.release_ip("rel-1", held.ip, force=True)
    assert [a.ip for a in released] == [held.ip]
    assert ipam.release_ip("rel-1", held.ip) == []  # idempotent
    assert ipam.allocations("rel-1") == []

    # A reservation (not committed yet) goes without force.
    res = ipam.allocate("rel-1", "c-res", families=[V4], expiration=60)[0]
    assert [a.ip for a in ipam.release_ip("rel-1", res.ip)] == [res.ip]
    # Release by owner, twice.
    both = ipam.allocate("rel-1", "c-own")
    assert {a.ip for a in ipam.release_owner("rel-1", "c-own")} == {a.ip for a in both}
    assert ipam.release_owner("rel-1", "c-own") == []
    # Releasing the IPv4 by IP (forced) leaves the owner its IPv6.
    both = ipam.allocate("rel-1", "c-half")
    ipam.release_ip("rel-1", both[0].ip, force=True)
    assert [a.ip for a in ipam.allocations("rel-1")] == [both[1].ip]
    assert ipam.allocate("rel-1", "c-half", families=[V6]) == [both[1]]


def test_reconcile_releases_exactly_the_owners_not_listed(ipam: Ipam) -> None:
    ipam.register("gc-1")
    ipam.register("gc-2")
    owners = [(f"gc-c{i}", "eth1" if i % 5 == 0 else "eth0") for i in range(60)]
    held: dict[tuple[str, str], set[str]] = {}
    for i, (cid, ifname) in enumerate(owners):
        fams = [V4] if i % 3 else []
        held[(cid, ifname)] = {a.ip for a in ipam.allocate("gc-1", cid, fams, ifname=ifname)}
    bystander = {a.ip for a in ipam.allocate("gc-2", "gc-c1")}
    rng = random.Random(7)
    valid = set(rng.sample(owners, 25))
    # Same container, other interface: not valid.
    valid.discard(("gc-c10", "eth1"))
    valid.add(("gc-c10", "eth0"))
    req = pb.ReconcileRequest(node="gc-1", valid_owners=[owner(c, i) for c, i in valid])
    released = ipam.stub.Reconcile(req).released
    expected = {ip for o, ips in held.items() if o not in valid for ip in ips}
    assert {a.ip for a in released} == expected
    assert len(released) == len(expected)
    assert all((a.owner.container_id, a.owner.ifname) not in valid for a in released)
    left = {(a.owner.container_id, a.owner.ifname, a.ip) for a in ipam.allocations("gc-1")}
    assert left == {(c, i, ip) for (c, i), ips in held.items() if (c, i) in valid for ip in ips}
    assert {a.ip for a in ipam.allocations("gc-2")} == bystander
    assert ipam.stub.Reconcile(req).released == []


def test_status_reports_mode_and_pool_usage(ipam: Ipam) -> None:
    node = ipam.register("status-1")
    for i in range(3):
        ipam.allocate("status-1", f"st-{i}", [V4] if i else [])
    status = ipam.stub.GetStatus(pb.GetStatusRequest())
    assert status.mode == pb.MODE_CLUSTER_POOL
    assert list(status.cluster_cidrs) == ["10.10.0.0/16", "fd00:10::/104"]
    assert (status.node_mask_size_v4, status.node_mask_size_v6) == (24, 120)
    pools = {(p.cidr): p for p in status.pools if p.node == "status-1"}
    assert pools[node.pod_cidrs[0]].allocated == 3
    assert pools[node.pod_cidrs[0]].capacity == 253
    assert pools[node.pod_cidrs[1]].allocated == 1


# --- errors ---


def test_rejected_requests_name_the_field_and_change_nothing(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    _, ipam = spawn_ipam(spawn, etcd, *CLUSTER, *MASKS)
    node = ipam.register("err-1")
    v4net = net(node.pod_cidrs[0])
    held = ipam.allocate("err-1", "c-held")
    ipam.allocate("err-1", "c-res", expiration=3600)
    s = ipam.stub
    before = (ipam.revision(), ipam.allocations(), ipam.nodes())

    def alloc(**kw: object) -> Callable[[], object]:
        return lambda: s.Allocate(pb.AllocateRequest(**kw))

    ok_owner = owner("c-new")
    ttl1 = pb.RegisterNodeRequest().lease_ttl
    ttl1.seconds = 1
    neg = pb.AllocateRequest().expiration
    neg.seconds = -1
    cases: list[tuple[Code, str, Callable[[], object]]] = [
        (Code.NOT_FOUND, "node", alloc(node="err-nope", owner=ok_owner)),
        (Code.INVALID_ARGUMENT, "node", alloc(node="Err_1", owner=ok_owner)),
        (Code.INVALID_ARGUMENT, "node", alloc(owner=ok_owner)),
        (Code.INVALID_ARGUMENT, "owner", alloc(node="err-1")),
        (Code.INVALID_ARGUMENT, "owner.container_id", alloc(node="err-1", owner=owner("-bad"))),
        (Code.INVALID_ARGUMENT, "owner.container_id", alloc(node="err-1", owner=owner("a/b"))),
        (Code.INVALID_ARGUMENT, "owner.ifname", alloc(node="err-1", owner=owner("c", "x" * 16))),
        (Code.INVALID_ARGUMENT, "owner.ifname", alloc(node="err-1", owner=owner("c", "a/b"))),
        (Code.INVALID_ARGUMENT, "families[0]", alloc(node="err-1", owner=ok_owner, families=[0])),
        (
            Code.INVALID_ARGUMENT,
            "families[1]",
            alloc(node="err-1", owner=ok_owner, families=[V4, V4]),
        ),
        (Code.INVALID_ARGUMENT, "expiration", alloc(node="err-1", owner=ok_owner, expiration=neg)),
        (Code.INVALID_ARGUMENT, "ip", lambda: ipam.allocate_ip("err-1", "10.10.300.1", "c-new")),
        (Code.INVALID_ARGUMENT, "ip", lambda: ipam.allocate_ip("err-1", "10.99.0.5", "c-new")),
        (
            Code.INVALID_ARGUMENT,
            "ip",
            lambda: ipam.allocate_ip("err-1", str(v4net.network_address + 1), "c-new"),
        ),
        (Code.ALREADY_EXISTS, "ip", lambda: ipam.allocate_ip("err-1", held[0].ip, "c-new")),
        (Code.NOT_FOUND, "node", lambda: ipam.allocate_ip("err-nope", "10.10.0.5", "c-new")),
        (Code.NOT_FOUND, "owner", lambda: ipam.commit("err-1", "c-new")),
        (Code.INVALID_ARGUMENT, "owner", lambda: s.CommitAllocation(pb.CommitAllocationRequest(node="err-1"))),
        (Code.INVALID_ARGUMENT, "target", lambda: s.Release(pb.ReleaseRequest(node="err-1"))),
        (Code.INVALID_ARGUMENT, "ip", lambda: ipam.release_ip("err-1", "10.99.0.5")),
        (Code.INVALID_ARGUMENT, "ip", lambda: ipam.release_ip("err-1", "nonsense")),
        (Code.FAILED_PRECONDITION, "ip", lambda: ipam.release_ip("err-1", held[0].ip)),
        (Code.NOT_FOUND, "node", lambda: ipam.release_owner("err-nope", "c-held")),
        (Code.NOT_FOUND, "node", lambda: ipam.allocations("err-nope")),
        (Code.INVALID_ARGUMENT, "family", lambda: ipam.allocations("err-1", 7)),
        (
            Code.NOT_FOUND,
            "node",
            lambda: s.Reconcile(pb.ReconcileRequest(node="err-nope")),
        ),
        (
            Code.INVALID_ARGUMENT,
            "valid_owners[1].ifname",
            lambda: s.Reconcile(
                pb.ReconcileRequest(node="err-1", valid_owners=[owner("a"), owner("b", "")])
            ),
        ),
        (Code.INVALID_ARGUMENT, "pod_cidrs", lambda: ipam.register("err-2", pod_cidrs=["10.1.0.0/24"])),
        (Code.INVALID_ARGUMENT, "pod_cidrs[0]", lambda: ipam.register("err-2", pod_cidrs=["10.1.0.0/33"])),
        (Code.INVALID_ARGUMENT, "name", lambda: ipam.register("")),
        (Code.INVALID_ARGUMENT, "name", lambda: ipam.register("a" * 254)),
        (
            Code.INVALID_ARGUMENT,
            "addresses[0].ip",
            lambda: ipam.register("err-2", addresses=[pb.NodeAddress(type=1, ip="1.2.3")]),
        ),
        (
            Code.INVALID_ARGUMENT,
            "addresses[0].type",
            lambda: ipam.register("err-2", addresses=[pb.NodeAddress(ip="1.2.3.4")]),
        ),
        (Code.INVALID_ARGUMENT, "datapath_address", lambda: ipam.register("err-2", datapath_address="nohost")),
        (Code.INVALID_ARGUMENT, "lease_ttl", lambda: ipam.register("err-2", lease_ttl=ttl1)),
        (Code.NOT_FOUND, "name", lambda: s.GetNode(pb.GetNodeRequest(name="err-nope"))),
        (Code.NOT_FOUND, "name", lambda: s.RenewNode(pb.RenewNodeRequest(name="err-nope"))),
        (Code.NOT_FOUND, "name", lambda: s.DeregisterNode(pb.DeregisterNodeRequest(name="err-nope"))),
        (
            Code.FAILED_PRECONDITION,
            "release_cidrs",
            lambda: s.DeregisterNode(pb.DeregisterNodeRequest(name="err-1", release_cidrs=True)),
        ),
        (
            Code.INVALID_ARGUMENT,
            "since_revision",
            lambda: next(s.WatchNodes(pb.WatchNodesRequest(since_revision=-1))),
        ),
    ]  # fmt: skip
    for code, field, call in cases:
        expect_error(code, field, call)
    after = (ipam.revision(), ipam.allocations(), ipam.nodes())
    assert after == before, "a rejected request changed etcd"


def test_bad_mask_size_exits_2_naming_the_option() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "flagella.ipam",
            "--cluster-cidr", "10.0.0.0/24",
            "--node-mask-size-v4", "16",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "flagella-ipam: error: invalid --node-mask-size-v4: "
        "16 is larger than the range: cluster CIDR 10.0.0.0/24 is a /24"
    )


def test_etcd_down_is_unavailable_and_nothing_is_half_written(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    _, ipam = spawn_ipam(spawn, etcd, *CLUSTER, *MASKS)
    ipam.register("down-1")
    ipam.allocate("down-1", "c-a")
    ipam.allocate("down-1", "c-b", expiration=3600)
    before = (ipam.allocations(), ipam.nodes())
    etcd.stop()
    try:
        s = ipam.stub
        calls: list[Callable[[], object]] = [
            lambda: ipam.allocate("down-1", "c-new"),
            lambda: ipam.allocate("down-1", "c-a"),
            lambda: ipam.allocate_ip("down-1", "10.10.0.77", "c-new2"),
            lambda: ipam.commit("down-1", "c-b"),
            lambda: ipam.release_owner("down-1", "c-a"),
            lambda: ipam.release_ip("down-1", before[0][0].ip, force=True),
            lambda: s.Reconcile(pb.ReconcileRequest(node="down-1")),
            lambda: ipam.register("down-2"),
            lambda: ipam.register("down-1"),
            lambda: s.GetNode(pb.GetNodeRequest(name="down-1")),
            lambda: s.DeregisterNode(pb.DeregisterNodeRequest(name="down-1")),
            lambda: s.GetStatus(pb.GetStatusRequest()),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == Code.UNAVAILABLE, info.value.details()
            assert "etcd" in info.value.details()
    finally:
        etcd.start()
    wait_for(lambda: _answers(ipam), timeout=20)
    assert (ipam.allocations(), ipam.nodes()) == before
    assert ipam.allocate("down-1", "c-a") == [a for a in before[0] if a.owner.container_id == "c-a"]
    assert ipam.allocate("down-1", "c-new")


def _answers(ipam: Ipam) -> bool:
    try:
        ipam.revision()
    except grpc.RpcError:
        time.sleep(0.2)
        return False
    return True


def test_a_second_internal_ip_of_a_family_is_refused(ipam: Ipam) -> None:
    """Other nodes route (native) or tunnel to a node's internal IP of each
    family: a registration naming two of one family is refused, naming the
    field, and registers nothing."""
    internal = pb.NodeAddress.TYPE_INTERNAL_IP
    message = expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        "addresses[1].ip",
        lambda: ipam.register(
            "two-v4",
            addresses=[
                pb.NodeAddress(type=internal, ip="192.168.0.11"),
                pb.NodeAddress(type=internal, ip="192.168.0.12"),
            ],
        ),
    )
    assert "192.168.0.12 is a second IPv4 internal IP (one per family)" in message
    assert "two-v4" not in ipam.nodes()
    both = ipam.register(
        "two-v4",
        addresses=[
            pb.NodeAddress(type=internal, ip="192.168.0.11"),
            pb.NodeAddress(type=internal, ip="fd00:100::11"),
        ],
    )
    assert [a.ip for a in both.addresses] == ["192.168.0.11", "fd00:100::11"]
