"""CreateEndpoint's orchestration against fake peers (pure logic): every
failure point rolls back exactly what was acquired, a repeated ADD answers
the same, restore rolls back interrupted creates."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from flagella.common.errors import Aborted, FailedPrecondition, NotFound, Unavailable
from flagella.common.portnames import NamedPort
from flagella.endpoint.model import Endpoint, State
from flagella.endpoint.service import (
    Allocated,
    CreateRequest,
    EndpointService,
    NodeInfo,
    RealizedEndpoint,
    SetupResult,
)
from flagella.endpoint.store import Created


class MemoryEtcdStore:
    """The EndpointStore interface over a dict (the real one is tested
    against etcd in the integration tests)."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, str], tuple[bytes, int]] = {}
        self.rev = 0
        self.next_id = 1
        self.writes = 0
        self.reads = 0

    async def get(self, cid: str, ifname: str) -> tuple[Endpoint, int] | None:
        self.reads += 1
        got = self.data.get((cid, ifname))
        return None if got is None else (Endpoint.from_json(got[0]), got[1])

    async def get_by_id(self, endpoint_id: int) -> tuple[Endpoint, int] | None:
        for raw, rev in self.data.values():
            ep = Endpoint.from_json(raw)
            if ep.id == endpoint_id:
                return ep, rev
        return None

    async def list_all(self) -> list[Endpoint]:
        return [Endpoint.from_json(raw) for raw, _ in self.data.values()]

    async def create(self, ep: Endpoint) -> Created:
        if ep.key in self.data:
            raw, rev = self.data[ep.key]
            return Created(False, Endpoint.from_json(raw), rev)
        ep.id = self.next_id
        self.next_id += 1
        self.rev += 1
        self.data[ep.key] = (ep.to_json(), self.rev)
        self.writes += 1
        return Created(True, ep, self.rev)

    async def update(self, ep: Endpoint, revision: int) -> int:
        assert self.data[ep.key][1] == revision
        self.writes += 1
        self.rev += 1
        self.data[ep.key] = (ep.to_json(), self.rev)
        return self.rev

    async def delete(self, ep: Endpoint) -> None:
        self.data.pop(ep.key, None)


@dataclass
class World:
    """Fake peers recording what is held, failing where told."""

    fail_at: str = ""
    ips: dict[tuple[str, str], str] = field(default_factory=dict)
    committed: set[tuple[str, str]] = field(default_factory=set)
    refs: dict[tuple[str, int], int] = field(default_factory=dict)  # (owner, identity) -> 1
    ipcache: dict[str, int] = field(default_factory=dict)
    veths: dict[int, int] = field(default_factory=dict)  # endpoint id -> identity
    next_ip: int = 5
    # Called right after each acquisition (a crash could come next).
    acquired: Callable[[str], None] | None = None

    def took(self, what: str) -> None:
        if self.acquired is not None:
            self.acquired(what)

    def maybe_fail(self, step: str) -> None:
        if self.fail_at == step:
            raise Unavailable(f"{step} down")

    # Ipam
    async def node(self, name: str) -> NodeInfo:
        self.maybe_fail("node")
        return NodeInfo(name, "dp:1", "192.0.2.1", ("10.0.0.0/24",))

    async def allocate(
        self, node: str, cid: str, ifname: str, pod: str, exp: float
    ) -> list[Allocated]:
        self.maybe_fail("allocate")
        if (cid, ifname) not in self.ips:
            self.ips[(cid, ifname)] = f"10.0.0.{self.next_ip}"
            self.next_ip += 1
            self.took("ip")
        return [Allocated(self.ips[(cid, ifname)], "10.0.0.0/24")]

    async def commit(self, node: str, cid: str, ifname: str) -> None:
        self.maybe_fail("commit")
        self.committed.add((cid, ifname))
        self.took("commit")

    async def release(self, node: str, cid: str, ifname: str) -> None:
        self.ips.pop((cid, ifname), None)
        self.committed.discard((cid, ifname))

    async def reconcile(self, node: str, valid: Sequence[tuple[str, str]]) -> list[str]:
        gone = [k for k in self.ips if k not in set(valid)]
        for k in gone:
            del self.ips[k]
        return [str(k) for k in gone]

    async def held(self, node: str) -> dict[str, tuple[str, str]]:
        return {ip: owner for owner, ip in self.ips.items()}

    async def claim(self, node: str, ip: str, cid: str, ifname: str, pod: str) -> None:
        self.ips[(cid, ifname)] = ip
        self.committed.add((cid, ifname))

    # Policy
    async def allocate_identity(
        self, labels: dict[str, str], node: str, owner: str
    ) -> tuple[int, int]:
        self.maybe_fail("identity")
        self.maybe_fail("revision")
        identity = 256 + len(labels)
        self.refs[(owner, identity)] = 1
        self.took("identity")
        return identity, 7

    async def release_identity(self, identity: int, node: str, owner: str) -> None:
        self.refs.pop((owner, identity), None)

    async def identity_of(self, labels: dict[str, str]) -> int:
        return 256 + len(labels)

    async def upsert_ipcache(
        self,
        prefix: str,
        identity: int,
        node: str,
        host_ip: str,
        named_ports: Sequence[NamedPort] = (),
    ) -> None:
        self.maybe_fail("ipcache")
        self.ipcache[prefix] = identity
        self.took("ipcache")

    async def delete_ipcache(self, prefix: str, identity: int) -> None:
        if self.ipcache.get(prefix) == identity:
            del self.ipcache[prefix]

    # Datapath
    async def setup(self, address: str, ep: Endpoint, pod_cidrs: Sequence[str]) -> SetupResult:
        self.maybe_fail("setup")
        self.veths[ep.id] = ep.identity
        self.took("veth")
        return SetupResult(
            f"lxc{ep.id:x}",
            "aa:aa",
            "bb:bb",
            1500,
            tuple(ep.addresses),
            ("169.254.1.1",),
            (("0.0.0.0/0", "169.254.1.1"),),
        )

    async def teardown(self, address: str, ep: Endpoint) -> None:
        self.veths.pop(ep.id, None)

    async def update_identity(self, address: str, endpoint_id: int, identity: int) -> None:
        self.veths[endpoint_id] = identity

    async def wait_policy(
        self, address: str, endpoint_id: int, min_revision: int, timeout: float
    ) -> int:
        self.maybe_fail("wait")
        return min_revision

    async def list_endpoints(self, address: str) -> list[RealizedEndpoint]:
        return [RealizedEndpoint(i, "", "", "", ident) for i, ident in self.veths.items()]

    def holdings(self) -> tuple[object, ...]:
        return (self.ips, self.refs, self.ipcache, self.veths)


def make(world: World) -> tuple[EndpointService, MemoryEtcdStore]:
    store = MemoryEtcdStore()
    return EndpointService(store, world, world, world), store  # type: ignore[arg-type]


REQ = CreateRequest("c1", "/proc/self/ns/net", "eth0", "n1", "web-1", "shop", {"app": "web"})


async def test_create_acquires_everything_and_repeat_is_identical() -> None:
    world = World()
    svc, store = make(world)
    ep = await svc.create(REQ)
    assert ep.state is State.READY
    assert ep.addresses == ["10.0.0.5/32"]
    assert world.committed == {("c1", "eth0")}
    assert world.ipcache == {"10.0.0.5/32": ep.identity}
    assert world.veths == {ep.id: ep.identity}
    again = await svc.create(REQ)
    assert again.id == ep.id
    assert again.result == ep.result
    assert len(store.data) == 1
    assert [e.to_state for e in ep.log] == ["waiting-for-identity", "regenerating", "ready"]


@pytest.mark.parametrize(
    "step", ["node", "allocate", "identity", "setup", "ipcache", "revision", "wait", "commit"]
)
async def test_failure_at_each_step_leaks_nothing(step: str) -> None:
    world = World(fail_at=step)
    svc, store = make(world)
    with pytest.raises(Unavailable):
        await svc.create(REQ)
    assert world.holdings() == ({}, {}, {}, {})
    assert store.data == {}
    world.fail_at = ""
    assert (await svc.create(REQ)).state is State.READY


async def test_an_endpoint_removed_under_an_add_answers_try_again() -> None:
    # Another replica's restore tore the datapath's endpoint down and has not
    # written the record yet: the ADD's own record looks untouched, but the
    # datapath no longer knows what it set up. A retry succeeds (CNI code
    # 11), so this is Aborted, never the NotFound a runtime takes as final.
    world = World()
    svc, store = make(world)

    async def torn_down(address: str, endpoint_id: int, min_revision: int, t: float) -> int:
        world.veths.pop(endpoint_id, None)
        raise NotFound(f"no endpoint {endpoint_id} on this node", field="endpoint_id")

    world.wait_policy = torn_down  # type: ignore[method-assign]
    with pytest.raises(Aborted):
        await svc.create(REQ)
    assert world.holdings() == ({}, {}, {}, {})
    assert store.data == {}
    del world.wait_policy
    assert (await svc.create(REQ)).state is State.READY


async def test_a_node_that_is_not_registered_stays_not_found() -> None:
    world = World()
    svc, _ = make(world)

    async def unknown(name: str) -> NodeInfo:
        raise NotFound(f"node {name} is not registered", field="node")

    world.node = unknown  # type: ignore[method-assign]
    with pytest.raises(NotFound):
        await svc.create(REQ)


async def test_delete_releases_everything_and_is_idempotent() -> None:
    world = World()
    svc, store = make(world)
    await svc.create(REQ)
    assert await svc.delete("c1", "eth0") is True
    assert world.holdings() == ({}, {}, {}, {})
    assert await svc.delete("c1", "eth0") is False
    assert store.data == {}
    assert len(svc._locks) == 0  # no per-attachment state left behind


async def test_restore_rolls_back_an_interrupted_create() -> None:
    world = World()
    svc, store = make(world)
    ready = await svc.create(REQ)
    # A create that crashed after its IP and identity, before the datapath.
    ep = Endpoint(id=0, container_id="c2", ifname="eth0", netns_path="/x", node="n1")
    await store.create(ep)
    found = await store.get("c2", "eth0")
    assert found is not None
    ep, rev = found
    ep.steps = ["ipam", "identity"]
    ep.identity = 300
    await world.allocate("n1", "c2", "eth0", "", 60)
    world.refs[("c2/eth0", 300)] = 1
    await store.update(ep, rev)

    restarted = EndpointService(store, world, world, world)  # type: ignore[arg-type]
    await restarted.restore()
    assert list(world.ips) == [("c1", "eth0")]
    assert [owner for owner, _ in world.refs] == ["c1/eth0"]
    assert [e.id for e in await store.list_all()] == [ready.id]


async def test_restore_releases_an_identity_taken_but_not_recorded() -> None:
    world = World()
    svc, store = make(world)
    ep = Endpoint(
        id=0,
        container_id="c3",
        ifname="eth0",
        netns_path="/x",
        node="n1",
        labels={"app": "web"},
        pod_namespace="shop",
    )
    await store.create(ep)
    found = await store.get("c3", "eth0")
    assert found is not None
    ep, rev = found
    ep.steps = ["ipam", "identity"]  # crashed after the allocation, before recording the id
    await store.update(ep, rev)
    await world.allocate_identity(
        {"app": "web", "io.kubernetes.pod.namespace": "shop"}, "n1", "c3/eth0"
    )
    assert world.refs
    await svc.restore()
    assert world.refs == {}


async def test_gc_removes_endpoints_and_ips_not_in_the_valid_set() -> None:
    world = World()
    svc, _ = make(world)
    await svc.create(REQ)
    await svc.create(CreateRequest("c2", "/proc/self/ns/net", "eth0", "n1"))
    await world.allocate("n1", "orphan", "eth0", "", 60)  # an IP with no endpoint
    removed = await svc.garbage_collect("n1", [("c1", "eth0")])
    assert [ep.container_id for ep in removed] == ["c2"]
    assert list(world.ips) == [("c1", "eth0")]


async def test_patch_labels_switches_identity_and_rolls_back_on_failure() -> None:
    world = World()
    svc, _ = make(world)
    ep = await svc.create(REQ)
    patched = await svc.patch_labels(ep.id, {"app": "web", "tier": "front"})
    assert patched.identity != ep.identity
    assert world.veths[ep.id] == patched.identity
    assert world.ipcache["10.0.0.5/32"] == patched.identity
    assert list(world.refs) == [("c1/eth0", patched.identity)]
    world.fail_at = "wait"
    with pytest.raises(Unavailable):
        await svc.patch_labels(ep.id, {"app": "other", "x": "1", "y": "2"})
    current = await svc.get_by_id(ep.id)
    assert current.identity == patched.identity
    assert current.state is State.READY
    assert world.veths[ep.id] == patched.identity
    assert list(world.refs) == [("c1/eth0", patched.identity)]


async def test_a_label_change_cancelled_midway_is_rolled_back() -> None:
    """A Kubernetes watcher's term can end while it changes an endpoint's
    identity: the change is undone, not left half-done."""
    world = World()
    svc, _ = make(world)
    ep = await svc.create(REQ)
    started = asyncio.Event()

    async def stuck(address: str, endpoint_id: int, min_revision: int, timeout: float) -> int:
        started.set()
        await asyncio.sleep(60)
        return min_revision

    world.wait_policy = stuck  # type: ignore[method-assign]
    task = asyncio.create_task(svc.patch_labels(ep.id, {"app": "web", "tier": "front"}))
    await started.wait()
    assert world.veths[ep.id] != ep.identity  # switched, waiting for its policy
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    current = await svc.get_by_id(ep.id)
    assert (current.identity, current.labels, current.state) == (
        ep.identity,
        ep.labels,
        State.READY,
    )
    assert world.veths[ep.id] == ep.identity
    assert world.ipcache["10.0.0.5/32"] == ep.identity
    assert list(world.refs) == [("c1/eth0", ep.identity)]


async def test_a_label_change_that_cannot_be_recorded_drops_its_new_identity() -> None:
    world = World()
    svc, store = make(world)
    ep = await svc.create(REQ)
    world.fail_at = "node"
    with pytest.raises(Unavailable):
        await svc.patch_labels(ep.id, {"app": "web", "tier": "front"})
    assert list(world.refs) == [("c1/eth0", ep.identity)]
    assert (await svc.get_by_id(ep.id)).identity == ep.identity
    # The same labels again: nothing to do, nothing written.
    world.fail_at = ""
    writes = store.writes
    assert (await svc.patch_labels(ep.id, dict(ep.labels))).identity == ep.identity
    assert store.writes == writes


async def test_restore_finishes_a_label_change_a_crash_interrupted() -> None:
    """A crash after the new identity is recorded: the pod runs, so restore
    finishes the change (it never removes the pod's networking) and drops
    the old identity."""
    world = World()
    svc, store = make(world)
    ep = await svc.create(REQ)
    crashed: dict[tuple[str, str], tuple[bytes, int]] = {}

    async def crash(address: str, endpoint_id: int, identity: int) -> None:
        crashed.update(store.data)  # etcd as the crash leaves it
        raise asyncio.CancelledError

    world.update_identity = crash  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await svc.patch_labels(ep.id, {"app": "web", "tier": "front"})
    new_identity = 256 + 3
    # The rollback never ran: the process was gone.
    world.refs[("c1/eth0", new_identity)] = 1
    del world.update_identity
    restarted, again = make(world)
    again.data = dict(crashed)
    again.rev = store.rev
    [interrupted] = await again.list_all()
    assert interrupted.state is State.REGENERATING
    await restarted.restore()
    current = await restarted.get_by_id(ep.id)
    assert (current.identity, current.state) == (new_identity, State.READY)
    assert current.labels == {"app": "web", "tier": "front"}
    assert not [s for s in current.steps if s.startswith("relabel")]
    assert world.veths[ep.id] == new_identity
    assert world.ipcache["10.0.0.5/32"] == new_identity
    assert list(world.refs) == [("c1/eth0", new_identity)]
    assert world.ips  # its address kept


async def test_labels_that_follow_kubernetes_change_only_from_there() -> None:
    world = World()
    svc, _ = make(world)
    ep = await svc.create(REQ)
    ep.labels_from_kubernetes = True  # as an ADD with kubernetes: true records it
    found = await svc.store.get(*ep.key)
    assert found is not None
    await svc.store.update(ep, found[1])
    with pytest.raises(FailedPrecondition) as refused:
        await svc.patch_labels(ep.id, {"app": "other"})
    assert refused.value.field == "labels"
    assert "Kubernetes" in refused.value.message
    moved = await svc.patch_labels(ep.id, {"app": "other", "x": "1"}, from_kubernetes=True)
    assert moved.identity != ep.identity


async def test_restore_reconciles_ready_endpoints_with_ipam_and_datapath() -> None:
    world = World()
    svc, store = make(world)
    ep = await svc.create(REQ)
    # Lost while the service was down: ipam's allocation and the node's veth.
    world.ips.clear()
    world.committed.clear()
    world.veths.clear()
    restarted = EndpointService(store, world, world, world)  # type: ignore[arg-type]
    await restarted.restore()
    assert world.ips == {("c1", "eth0"): "10.0.0.5"}  # the same address, claimed again
    assert world.committed == {("c1", "eth0")}
    assert list(world.veths) == [ep.id]
    assert (await restarted.get("c1", "eth0")).state is State.READY


async def test_an_add_writes_its_record_three_times_and_reads_nothing() -> None:
    world = World()
    svc, store = make(world)
    await svc.create(REQ)
    assert (store.writes, store.reads) == (3, 0)


async def test_a_crash_right_after_any_acquisition_is_rolled_back_by_restore() -> None:
    """At every moment a peer has just handed something out, the record in
    the store already names the step (its intent): a service restarted from
    that store and that world releases everything, and nothing else."""
    world = World()
    svc, store = make(world)
    keeper = await svc.create(CreateRequest("keep", "/x", "eth0", "n1", labels={"app": "k"}))
    kept = (dict(world.ips), dict(world.refs), dict(world.ipcache), dict(world.veths))
    crashes: list[tuple[str, dict[tuple[str, str], tuple[bytes, int]], World]] = []

    def crash_here(what: str) -> None:
        # What a kill -9 now would leave: the store and the peers as they are.
        frozen = World(
            ips=dict(world.ips),
            committed=set(world.committed),
            refs=dict(world.refs),
            ipcache=dict(world.ipcache),
            veths=dict(world.veths),
            next_ip=world.next_ip,
        )
        crashes.append((what, dict(store.data), frozen))

    world.acquired = crash_here
    await svc.create(REQ)
    assert [what for what, _, _ in crashes] == ["ip", "identity", "veth", "ipcache", "commit"]
    for what, data, frozen in crashes:
        restarted_store = MemoryEtcdStore()
        restarted_store.data = data
        restarted = EndpointService(restarted_store, frozen, frozen, frozen)  # type: ignore[arg-type]
        await restarted.restore()
        assert frozen.holdings() == kept, what
        assert [e.id for e in await restarted_store.list_all()] == [keeper.id], what


async def test_concurrent_steps_are_both_finished_before_the_rollback() -> None:
    """When ipam fails while the identity is still being allocated, the
    rollback waits for it, so the reference it takes is released too."""
    world = World(fail_at="allocate")
    gate = asyncio.Event()
    allocate_identity = world.allocate_identity

    async def slow_identity(labels: dict[str, str], node: str, owner: str) -> tuple[int, int]:
        await gate.wait()
        return await allocate_identity(labels, node, owner)

    world.allocate_identity = slow_identity  # type: ignore[method-assign]
    svc, store = make(world)
    task = asyncio.create_task(svc.create(REQ))
    await asyncio.sleep(0.01)
    assert not task.done()  # waiting for the identity, though ipam failed
    gate.set()
    with pytest.raises(Unavailable):
        await task
    assert world.holdings() == ({}, {}, {}, {})
    assert store.data == {}
