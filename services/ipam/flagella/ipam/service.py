"""Logic of the ipam service (no gRPC here): the node registry, node pod
CIDRs in cluster-pool and host-scope modes, IP allocation with expiring
reservations, release, CNI GC and status.

Every decision that several replicas could race on is taken by an etcd
transaction (store.py); the in-memory PoolCache only suggests candidates.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from flagella.common.backoff import Backoff, retry
from flagella.common.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    FlagellaError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from flagella.common.outcomes import Outcomes, counted
from flagella.common.sync import Subscription
from flagella.common.tasks import TaskGroup
from flagella.ipam.kube import node_annotations
from flagella.ipam.model import (
    AddressType,
    Allocation,
    Family,
    Mode,
    Node,
    NodeRegistration,
    Owner,
    PoolUsage,
    Status,
    sort_key,
)
from flagella.ipam.pool import (
    MAX_PREFIX,
    IPAddress,
    IPNetwork,
    Pool,
    capacity_of,
    free_block,
    reserved_reason,
)
from flagella.ipam.store import (
    MAX_NODE_ID,
    OWNERS_PER_TXN,
    IpamStore,
    NodeCidrs,
    NodePools,
    OwnerIndex,
    OwnerState,
)

log = logging.getLogger(__name__)

#: Transactions one call may lose to concurrent writers before ABORTED.
MAX_ATTEMPTS = 64
#: Lost races on candidate IPs after which the pool is re-read from etcd.
RESYNC_AFTER_CONFLICTS = 8
MAX_LEASE_TTL = 86_400


@dataclass(frozen=True)
class Settings:
    mode: Mode = Mode.CLUSTER_POOL
    cluster_cidrs: tuple[IPNetwork, ...] = ()
    node_mask_size_v4: int = 24
    node_mask_size_v6: int = 112
    default_lease_ttl: int = 30
    expiry_check_interval: float = 1.0
    # Seconds between SYNCED heartbeats on an idle WatchNodes stream.
    watch_heartbeat: float = 30.0

    def mask(self, family: Family) -> int:
        return self.node_mask_size_v4 if family is Family.IPV4 else self.node_mask_size_v6

    @property
    def cluster_families(self) -> set[Family]:
        return {Family.of(c) for c in self.cluster_cidrs}


class NodeCidrSource(Protocol):
    """Where host-scope mode reads a node's pod CIDRs (the Kubernetes Node)."""

    async def pod_cidrs(self, name: str) -> list[str]:
        """The Node's spec.podCIDRs (else its pod CIDR annotations).
        NotFound, FailedPrecondition or Unavailable, each naming the field
        "name"."""

    async def annotate_node(self, name: str, annotations: dict[str, str]) -> None:
        """Merge annotations into the Node's (NotFound, Unavailable)."""


def _cidrs_text(cidrs: Sequence[IPNetwork]) -> str:
    return ", ".join(str(c) for c in cidrs) or "none"


def check_pod_cidrs(cidrs: Sequence[IPNetwork], field: str) -> None:
    """At most one CIDR per family, each leaving room for pods."""
    seen: set[int] = set()
    for i, net in enumerate(cidrs):
        if net.version in seen:
            raise InvalidArgument(
                f"more than one {Family.of(net).label} CIDR (one per family)", field=f"{field}[{i}]"
            )
        seen.add(net.version)
        if net.prefixlen > MAX_PREFIX[net.version]:
            raise InvalidArgument(
                f"{net}: a /{net.prefixlen} leaves no room for pods "
                f"(at most /{MAX_PREFIX[net.version]})",
                field=f"{field}[{i}]",
            )


class IpamService:
    def __init__(
        self,
        store: IpamStore,
        settings: Settings | None = None,
        *,
        tasks: TaskGroup,
        kube: NodeCidrSource | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.cache = store.cache
        self.settings = settings or Settings()
        self.tasks = tasks
        self.kube = kube
        self.clock = clock
        # Blocks other replicas took that our cache has not seen yet.
        self._learned_blocks: dict[IPNetwork, int] = {}
        # Blocks and node ids that registrations in flight here are trying:
        # concurrent registrations pick others instead of all picking the
        # lowest free one and all but one failing (800 nodes joining at
        # once conflicted on every carve).
        self._claimed_blocks: set[IPNetwork] = set()
        self._claimed_ids: set[int] = set()
        # Node ids known taken (id -> node): read from etcd once, then kept
        # by this replica's registrations and what their transactions found
        # taken, instead of a read of every id per registration. None until
        # first needed.
        self._node_ids: dict[int, str] | None = None
        # (operation, outcome) of allocations and releases, for the metrics.
        self.outcomes = Outcomes()
        # Node -> the annotations last written back to its Kubernetes Node,
        # and the write-back still retrying.
        self._annotated: dict[str, dict[str, str]] = {}
        self._annotating: dict[str, asyncio.Task[None]] = {}
        self.annotate_backoff = Backoff(0.2, 10.0)

    # --- lifecycle ---

    async def start(self) -> None:
        """Follow etcd's nodes and pools and start the expiry sweep (in the
        task group, which stops them); returns once the first snapshots are
        in."""
        await self.store.start()
        self.tasks.spawn("ipam-expiry-sweep", self._sweep_loop())

    async def stop(self) -> None:
        batcher = self.store.batcher
        log.info(
            "allocation transactions",
            extra={"grouped_txns": batcher.batches, "grouped_writes": batcher.batched},
        )

    # --- node registry ---

    async def register_node(self, reg: NodeRegistration) -> Node:
        ttl = reg.lease_ttl or self.settings.default_lease_ttl
        want = await self._wanted_cidrs(reg)
        lease = await self.store.grant_lease(ttl)
        claimed_blocks: list[IPNetwork] = []
        claimed_id: int | None = None
        try:
            for _ in range(MAX_ATTEMPTS):
                current, cidrs, ident = await self.store.get_registration_state(reg.name)
                have = cidrs.cidrs if cidrs is not None else ()
                self._unclaim(claimed_blocks, claimed_id)
                claimed_blocks, claimed_id = [], None
                if ident is not None:
                    node_id = ident.id
                else:
                    node_id = claimed_id = await self._free_node_id()
                    self._claimed_ids.add(node_id)
                if self.settings.mode is Mode.CLUSTER_POOL:
                    new_blocks = claimed_blocks = self._carve(have)
                    self._claimed_blocks.update(new_blocks)
                else:
                    new_blocks = self._host_scope_blocks(reg.name, have, want)
                node = Node(
                    name=reg.name,
                    addresses=reg.addresses,
                    datapath_address=reg.datapath_address,
                    pod_cidrs=tuple(sorted([*have, *new_blocks], key=sort_key)),
                    labels=dict(reg.labels),
                    lease_ttl=ttl,
                    registered_at=self.clock(),
                    id=node_id,
                )
                out = await self.store.write_registration(
                    node,
                    lease,
                    node_revision=current[0].revision if current is not None else 0,
                    cidrs_revision=cidrs.revision if cidrs is not None else 0,
                    new_blocks=new_blocks,
                    id_revision=ident.revision if ident is not None else 0,
                )
                if out.ok:
                    if current is not None and current[1] and current[1] != lease:
                        with contextlib.suppress(Unavailable):
                            await self.store.revoke_lease(current[1])
                    if new_blocks:
                        self.cache.set_node(reg.name, NodeCidrs(node.pod_cidrs, out.revision))
                    if self._node_ids is not None:
                        self._node_ids[node_id] = reg.name
                    self._annotate_later(node)
                    log.info(
                        "node registered",
                        extra={
                            "node": reg.name,
                            "pod_cidrs": [str(c) for c in node.pod_cidrs],
                            "lease_ttl_s": ttl,
                        },
                    )
                    return replace(node, revision=out.revision, lease=lease)
                for block, (holder, rev) in out.conflicts.items():
                    if self.settings.mode is Mode.HOST_SCOPE and holder != reg.name:
                        i = list(want).index(block)
                        raise AlreadyExists(
                            f"{block} is the pod CIDR of node {holder}", field=f"pod_cidrs[{i}]"
                        )
                    self._learned_blocks[block] = rev
                if out.id_holder is not None and self._node_ids is not None:
                    self._node_ids[node_id] = out.id_holder
            raise Aborted("too many concurrent registrations; retry", field="name")
        except BaseException:
            with contextlib.suppress(Unavailable):
                await self.store.revoke_lease(lease)
            raise
        finally:
            self._unclaim(claimed_blocks, claimed_id)

    def _unclaim(self, blocks: Sequence[IPNetwork], node_id: int | None) -> None:
        self._claimed_blocks.difference_update(blocks)
        if node_id is not None:
            self._claimed_ids.discard(node_id)

    # --- AnnotateNode: the write-back to Kubernetes ---

    def invalid_annotation(self, annotation: str) -> None:
        """A Node's pod CIDR annotation was ignored (kube.py logged it)."""
        self.outcomes.record("node_cidr_annotation", outcome="invalid_argument")

    def _annotate_later(self, node: Node) -> None:
        """Write the node's CIDRs and health addresses to its Kubernetes
        Node in the background, retried until it succeeds (registration
        never waits on the API server). A newer registration's write-back
        replaces a pending one."""
        if self.kube is None:
            return
        annotations = node_annotations(
            [str(c) for c in node.pod_cidrs],
            [a.ip for a in node.addresses if a.type is AddressType.INTERNAL_IP],
        )
        if self._annotated.get(node.name) == annotations:
            return
        pending = self._annotating.pop(node.name, None)
        if pending is not None:
            pending.cancel()
        self._annotating[node.name] = self.tasks.spawn(
            f"annotate-node-{node.name}", self._annotate(node.name, annotations)
        )

    async def _annotate(self, name: str, annotations: dict[str, str]) -> None:
        kube = self.kube
        assert kube is not None

        async def once() -> None:
            with self.outcomes.counting("annotate_node"):
                await kube.annotate_node(name, annotations)

        backoff = Backoff(self.annotate_backoff.initial, self.annotate_backoff.maximum)
        try:
            await retry(
                once,
                what=f"annotating Kubernetes Node {name}",
                retry_on=(Unavailable, NotFound),
                backoff=backoff,
            )
        finally:
            if self._annotating.get(name) is asyncio.current_task():
                del self._annotating[name]
        self._annotated[name] = annotations
        log.info("Kubernetes Node annotated", extra={"node": name, "annotations": annotations})

    async def _free_node_id(self) -> int:
        """The lowest node id no node holds as far as this replica knows,
        and no registration in flight here tries (the registration's
        transaction checks it is still free, and tells who holds it when it
        is not). When every id looks taken, etcd is read again: ids freed
        by other replicas are then seen."""
        for fresh in (False, True):
            if fresh or self._node_ids is None:
                self._node_ids, _ = await self.store.node_ids()
            taken, claimed = self._node_ids, self._claimed_ids
            for ident in range(1, MAX_NODE_ID + 1):
                if ident not in taken and ident not in claimed:
                    return ident
        raise ResourceExhausted(f"all {MAX_NODE_ID} node ids are taken", field="name")

    async def node_ids(self) -> list[tuple[int, str, tuple[str, ...]]]:
        """(id, node, the node's addresses when it is registered) for each
        node id, by id."""
        taken, _ = await self.store.node_ids()
        nodes, _ = await self.store.list_nodes()
        addresses = {n.name: tuple(a.ip for a in n.addresses) for n in nodes}
        return [(i, name, addresses.get(name, ())) for i, name in sorted(taken.items())]

    async def _wanted_cidrs(self, reg: NodeRegistration) -> tuple[IPNetwork, ...]:
        """host-scope: the CIDRs the node must have."""
        if self.settings.mode is Mode.CLUSTER_POOL:
            if reg.pod_cidrs:
                raise InvalidArgument(
                    "only in host-scope mode: cluster-pool mode assigns pod CIDRs itself",
                    field="pod_cidrs",
                )
            return ()
        if self.kube is None:
            if not reg.pod_cidrs:
                raise InvalidArgument(
                    "host-scope mode needs the node's pod CIDRs (or --kubeconfig)",
                    field="pod_cidrs",
                )
            check_pod_cidrs(reg.pod_cidrs, "pod_cidrs")
            return reg.pod_cidrs
        raw = await self.kube.pod_cidrs(reg.name)
        nets: list[IPNetwork] = []
        for text in raw:
            try:
                nets.append(ipaddress.ip_network(text, strict=True))
            except ValueError:
                raise FailedPrecondition(
                    f"the Kubernetes Node has an invalid spec.podCIDRs entry {text!r}", field="name"
                ) from None
        try:
            check_pod_cidrs(nets, "spec.podCIDRs")
        except InvalidArgument as exc:
            raise FailedPrecondition(f"the Kubernetes Node's {exc.details}", field="name") from None
        if reg.pod_cidrs and set(reg.pod_cidrs) != set(nets):
            raise InvalidArgument(
                f"differs from the Kubernetes Node's spec.podCIDRs ({_cidrs_text(nets)})",
                field="pod_cidrs",
            )
        return tuple(nets)

    def _host_scope_blocks(
        self, name: str, have: Sequence[IPNetwork], want: Sequence[IPNetwork]
    ) -> list[IPNetwork]:
        if have:
            if set(have) != set(want):
                raise FailedPrecondition(
                    f"node {name} already has pod CIDRs {_cidrs_text(have)}; deregister it "
                    "with release_cidrs (once its allocations are released) to change them",
                    field="pod_cidrs",
                )
            return []
        assigned = self.cache.assigned_cidrs()
        for i, net in enumerate(want):
            for other, holder in assigned.items():
                if holder != name and other.overlaps(net):
                    raise AlreadyExists(
                        f"{net} overlaps {other}, the pod CIDR of node {holder}",
                        field=f"pod_cidrs[{i}]",
                    )
        return list(want)

    def _carve(self, have: Sequence[IPNetwork]) -> list[IPNetwork]:
        """cluster-pool: a new block for each enabled family the node has no
        CIDR of."""
        self._learned_blocks = {
            b: rev for b, rev in self._learned_blocks.items() if rev > self.cache.revision
        }
        assigned = (
            set(self.cache.assigned_cidrs()) | set(self._learned_blocks) | self._claimed_blocks
        )
        have_families = {Family.of(c) for c in have}
        new: list[IPNetwork] = []
        for family in (Family.IPV4, Family.IPV6):
            clusters = [c for c in self.settings.cluster_cidrs if Family.of(c) is family]
            if not clusters or family in have_families:
                continue
            mask = self.settings.mask(family)
            for cluster in clusters:
                block = free_block(cluster, mask, [a for a in assigned if a.overlaps(cluster)])
                if block is not None:
                    new.append(block)
                    assigned.add(block)
                    break
            else:
                raise ResourceExhausted(
                    f"no free /{mask} block left in cluster CIDRs {_cidrs_text(clusters)}",
                    field="name",
                )
        return new

    async def renew_node(self, name: str) -> int:
        """Refresh the node's lease; returns its TTL in seconds. The lease
        is the one this replica's node table has (every renewal read it
        from etcd before: a read per node every 10 s); etcd is read only
        when that lease is gone (the table may not have seen a newer
        registration yet)."""
        known = self.store.nodes.get(name)
        if known is not None and known.lease:
            ttl = await self.store.keepalive(known.lease)
            if ttl > 0:
                return ttl
        got = await self.store.get_node(name)
        if got is not None and (known is None or got[1] != known.lease):
            ttl = await self.store.keepalive(got[1])
            if ttl > 0:
                return ttl
        raise NotFound(
            f"node {name} is not registered (or its lease expired): register it again",
            field="name",
        )

    async def deregister_node(self, name: str, *, release_cidrs: bool) -> None:
        for _ in range(MAX_ATTEMPTS):
            current, cidrs, ident = await self.store.get_registration_state(name)
            if current is None and (cidrs is None or not release_cidrs):
                raise NotFound(f"node {name} is not registered", field="name")
            release = cidrs if release_cidrs else None
            ok, left = await self.store.delete_node(
                name,
                node_revision=current[0].revision if current is not None else 0,
                cidrs=release,
                # The id goes with the node for good (its CIDRs released).
                ident=ident if release_cidrs else None,
            )
            if ok:
                if current is not None and current[1]:
                    with contextlib.suppress(Unavailable):
                        await self.store.revoke_lease(current[1])
                if release is not None:
                    self.cache.set_node(name, None)
                    if ident is not None and self._node_ids is not None:
                        self._node_ids.pop(ident.id, None)
                log.info("node deregistered", extra={"node": name, "released_cidrs": release_cidrs})
                return
            if left:
                raise FailedPrecondition(
                    f"node {name} still has {left} allocation(s): release them first "
                    "(its pod CIDRs are kept)",
                    field="release_cidrs",
                )
        raise Aborted("too many concurrent changes; retry", field="name")

    async def get_node(self, name: str) -> Node:
        got = await self.store.get_node(name)
        if got is None:
            raise NotFound(f"node {name} is not registered", field="name")
        return got[0]

    async def list_nodes(self) -> tuple[list[Node], int]:
        return await self.store.list_nodes()

    async def watch_nodes(self, since_revision: int) -> Subscription[str, Node]:
        """The registry as a snapshot (since 0) or the changes after
        since_revision, then its changes as they happen."""
        return await self.store.subscribe_nodes(since_revision)

    # --- pools ---

    async def _node_pools(self, node: str) -> NodePools:
        """The node's pools, from the cache or else from etcd. NotFound for a
        node that never registered (or released its CIDRs)."""
        entry = self.cache.nodes.get(node)
        if entry is not None:
            return entry
        cidrs = await self.store.get_cidrs(node)
        if cidrs is None:
            raise NotFound(f"unknown node {node}: it has no pod CIDRs", field="node")
        return await self._install(node, cidrs)

    async def _install(self, node: str, cidrs: NodeCidrs) -> NodePools:
        """Put CIDRs read from etcd into the cache, reading the pools' used
        IPs when the cache did not follow them itself."""
        before = self.cache.nodes.get(node)
        entry = self.cache.set_node(node, cidrs)
        assert entry is not None
        if entry is not before:
            for family, pool in entry.pools.items():
                if before is None or before.pools.get(family) is not pool:
                    await self.cache.resync_pool(node, family, cidrs.revision)
        return entry

    def _enabled(self, entry: NodePools) -> list[Family]:
        families = sorted(entry.pools)
        if self.settings.mode is Mode.CLUSTER_POOL:
            families = [f for f in families if f in self.settings.cluster_families]
        return families

    def _families(self, node: str, entry: NodePools, requested: Sequence[Family]) -> list[Family]:
        enabled = self._enabled(entry)
        if not requested:
            if not enabled:
                raise FailedPrecondition(f"node {node} has no enabled family", field="node")
            return enabled
        out: list[Family] = []
        for i, family in enumerate(requested):
            if family in out:
                raise InvalidArgument(f"{family.label} is asked twice", field=f"families[{i}]")
            if family not in enabled:
                raise InvalidArgument(
                    f"{family.label} is not enabled on node {node} "
                    f"(pod CIDRs: {_cidrs_text(entry.cidrs)})",
                    field=f"families[{i}]",
                )
            out.append(family)
        return out

    async def _take(self, node: str, family: Family, pool: Pool) -> int:
        """A candidate offset (pending). When the pool looks full, etcd says
        whether it is."""
        off = pool.take()
        if off is not None:
            return off
        count, revision = await self.store.count_pool(node, family)
        if count < pool.capacity:
            await self.cache.resync_pool(node, family, revision)
            off = pool.take()
            if off is not None:
                return off
        raise ResourceExhausted(
            f"no free {family.label} address left in {pool.network} of node {node} "
            f"({count} of {pool.capacity} allocated)",
            field="node",
        )

    # --- allocation ---

    def _expiry(self, now: float, expiration: float) -> float | None:
        return now + expiration if expiration > 0 else None

    @counted("allocate")
    async def allocate(
        self,
        node: str,
        owner: Owner,
        families: Sequence[Family] = (),
        *,
        expiration: float = 0.0,
    ) -> list[Allocation]:
        """The next free IP of each family for owner; the same IPs again when
        the owner already holds them."""
        entry = await self._node_pools(node)
        wanted = self._families(node, entry, families)
        now = self.clock()
        expires_at = self._expiry(now, expiration)
        index: OwnerIndex | None = None  # optimistic: a new owner
        existing: dict[Family, Allocation] = {}
        conflicts = 0
        for _ in range(MAX_ATTEMPTS):
            need = [f for f in wanted if f not in existing]
            if not need:
                return [existing[f] for f in wanted]
            picks: list[tuple[Pool, int]] = []
            try:
                for family in need:
                    pool = entry.pools[family]
                    picks.append((pool, await self._take(node, family, pool)))
            except ResourceExhausted:
                for pool, off in picks:
                    pool.settle(off)
                if index is not None:
                    raise
                # A retry of an owner that already holds its IPs still gets them.
                index = await self.store.get_owner_index(node, owner)
                if index is None:
                    raise
                existing = await self._held(node, index, wanted)
                continue
            new = [
                Allocation(
                    ip=pool.ip_at(off),
                    node=node,
                    owner=owner,
                    cidr=pool.network,
                    allocated_at=now,
                    expires_at=expires_at,
                )
                for pool, off in picks
            ]
            try:
                out = await self.store.create_allocations(
                    node, owner, new, cidrs_revision=entry.revision, owner_index=index
                )
            finally:
                for pool, off in picks:
                    pool.settle(off)
            if out.ok:
                for (pool, _), a in zip(picks, new, strict=True):
                    self.cache.learn_used(pool, a.ip, out.revision)
                got = {**existing, **{a.family: replace(a, revision=out.revision) for a in new}}
                return [got[f] for f in wanted]
            if out.cidrs is None:
                self.cache.set_node(node, None)
                raise NotFound(f"unknown node {node}: it has no pod CIDRs", field="node")
            if out.cidrs.revision != entry.revision:
                entry = await self._install(node, out.cidrs)
                wanted = self._families(node, entry, families)
                continue
            for ip, holder in out.taken.items():
                pool_of = entry.pool_of(ip)
                if pool_of is not None:
                    self.cache.learn_used(pool_of, ip, holder.revision)
            conflicts += len(out.taken)
            if out.taken and conflicts % RESYNC_AFTER_CONFLICTS == 0:
                for family in {Family.of(ip) for ip in out.taken}:
                    await self.cache.resync_pool(node, family, out.revision)
            if out.owner != index:
                index = out.owner
                existing = await self._held(node, index, wanted) if index is not None else {}
        raise Aborted("too many concurrent allocations; retry", field="node")

    async def _held(
        self, node: str, index: OwnerIndex, wanted: Sequence[Family]
    ) -> dict[Family, Allocation]:
        held: dict[Family, Allocation] = {}
        for a in await self.store.get_allocations(node, index.ips):
            if a.family in wanted and a.family not in held:
                held[a.family] = a
        return held

    def _pool_for_ip(self, node: str, entry: NodePools, ip: IPAddress) -> Pool:
        pool = entry.pool_of(ip)
        if pool is None:
            raise InvalidArgument(
                f"{ip} is outside the pod CIDRs of node {node} ({_cidrs_text(entry.cidrs)})",
                field="ip",
            )
        return pool

    @counted("allocate")
    async def allocate_ip(
        self, node: str, ip: IPAddress, owner: Owner, *, expiration: float = 0.0
    ) -> Allocation:
        entry = await self._node_pools(node)
        pool = self._pool_for_ip(node, entry, ip)
        family = Family.of(ip)
        if family not in self._enabled(entry):
            raise InvalidArgument(f"{family.label} is not enabled", field="ip")
        reason = reserved_reason(pool.network, ip)
        if reason is not None:
            raise InvalidArgument(f"{ip} {reason} of {pool.network}: never handed out", field="ip")
        now = self.clock()
        index: OwnerIndex | None = None
        for _ in range(MAX_ATTEMPTS):
            new = Allocation(
                ip=ip,
                node=node,
                owner=owner,
                cidr=pool.network,
                allocated_at=now,
                expires_at=self._expiry(now, expiration),
            )
            out = await self.store.create_allocations(
                node, owner, [new], cidrs_revision=entry.revision, owner_index=index
            )
            if out.ok:
                self.cache.learn_used(pool, ip, out.revision)
                return replace(new, revision=out.revision)
            if out.cidrs is None:
                self.cache.set_node(node, None)
                raise NotFound(f"unknown node {node}: it has no pod CIDRs", field="node")
            if out.cidrs.revision != entry.revision:
                entry = await self._install(node, out.cidrs)
                pool = self._pool_for_ip(node, entry, ip)
                continue
            holder = out.taken.get(ip)
            if holder is not None:
                self.cache.learn_used(pool, ip, holder.revision)
                if holder.owner.ident == owner.ident:
                    return holder
                raise AlreadyExists(f"{ip} is allocated to {holder.owner}", field="ip")
            index = out.owner
            if index is not None:
                same = [x for x in index.ips if x.version == ip.version and x != ip]
                if same:
                    raise AlreadyExists(
                        f"{owner} already holds {family.label} address {same[0]}", field="owner"
                    )
        raise Aborted("too many concurrent changes; retry", field="ip")

    async def commit(self, node: str, owner: Owner) -> list[Allocation]:
        """Clear the expiration of the owner's allocations."""
        await self._node_pools(node)
        for _ in range(MAX_ATTEMPTS):
            state = await self.store.load_owner(node, owner)
            if state.index is None or not state.allocations:
                raise NotFound(
                    f"{owner} holds no allocation on node {node} (released, or its "
                    "reservation expired)",
                    field="owner",
                )
            reserved = [a for a in state.allocations.values() if a.expires_at is not None]
            if not reserved:
                return _ordered(state.allocations.values())
            updated = [replace(a, expires_at=None) for a in reserved]
            ok, revision = await self.store.update_owner(node, owner, state, put=updated)
            if ok:
                done = {a.ip: replace(a, revision=revision) for a in updated}
                return _ordered({**state.allocations, **done}.values())
        raise Aborted("too many concurrent changes; retry", field="owner")

    @counted("release")
    async def release_ip(
        self, node: str, ip: IPAddress, *, force: bool = False
    ) -> list[Allocation]:
        entry = await self._node_pools(node)
        self._pool_for_ip(node, entry, ip)
        for _ in range(MAX_ATTEMPTS):
            a = await self.store.get_allocation(node, ip)
            if a is None:
                return []
            index = await self.store.get_owner_index(node, a.owner)
            held = index is not None and ip in index.ips
            if held and a.committed and not force:
                raise FailedPrecondition(
                    f"{ip} is in use by {a.owner} (committed): release it by owner, or set force",
                    field="ip",
                )
            ok, _ = await self.store.update_owner(
                node, a.owner, OwnerState(index, {ip: a}), delete=[ip]
            )
            if ok:
                return [a]
        raise Aborted("too many concurrent changes; retry", field="ip")

    @counted("release")
    async def release_owner(self, node: str, owner: Owner) -> list[Allocation]:
        await self._node_pools(node)
        for _ in range(MAX_ATTEMPTS):
            index = await self.store.get_owner_index(node, owner)
            if index is None:
                return []
            released = await self.store.delete_owners(node, [(owner, index)])
            if released is not None:
                return _ordered(released)
        raise Aborted("too many concurrent changes; retry", field="owner")

    async def list_allocations(
        self, node: str | None = None, family: Family | None = None
    ) -> tuple[list[Allocation], int]:
        if node is not None:
            await self._node_pools(node)
        return await self.store.list_allocations(node, family)

    async def reconcile(self, node: str, valid_owners: Sequence[Owner]) -> list[Allocation]:
        """CNI GC: release every allocation of the node whose owner is not in
        valid_owners."""
        await self._node_pools(node)
        keep = {o.ident for o in valid_owners}
        stale = [(o, idx) for o, idx in await self.store.list_owners(node) if o.ident not in keep]
        released: list[Allocation] = []
        for i in range(0, len(stale), OWNERS_PER_TXN):
            batch = stale[i : i + OWNERS_PER_TXN]
            got = await self.store.delete_owners(node, batch)
            if got is None:  # one of them changed meanwhile: one by one
                got = []
                for owner, _ in batch:
                    got += await self.release_owner(node, owner)
            released += got
        if released:
            log.info("reconcile released", extra={"node": node, "released": len(released)})
        return _ordered(released)

    # --- expiry ---

    async def sweep_expired(self) -> list[Allocation]:
        """Release every reservation past its expiry (any replica may do it;
        compares make concurrent sweeps harmless)."""
        now = self.clock()
        released: list[Allocation] = []
        for (node, owner), ips in self.cache.expired(now).items():
            released += await self._release_expired(node, owner, ips, now)
        if released:
            log.info(
                "expired reservations released",
                extra={"released": [f"{a.node}/{a.ip}" for a in released]},
            )
        return released

    async def _release_expired(
        self, node: str, owner: Owner, ips: Sequence[IPAddress], now: float
    ) -> list[Allocation]:
        for _ in range(8):
            state = await self.store.load_owner(node, owner)
            if state.index is None:
                # Keys without an index (never written so): look at them alone.
                found = await self.store.get_allocations(node, ips)
                state = OwnerState(None, {a.ip: a for a in found if a.owner.ident == owner.ident})
            expired = [
                a
                for a in state.allocations.values()
                if a.expires_at is not None and a.expires_at <= now
            ]
            if not expired:
                return []
            ok, _ = await self.store.update_owner(
                node, owner, state, delete=[a.ip for a in expired]
            )
            if ok:
                return expired
        return []

    async def _sweep_loop(self) -> None:
        interval = self.settings.expiry_check_interval
        while True:
            # Jitter keeps replicas from sweeping in lockstep.
            await asyncio.sleep(interval * random.uniform(0.75, 1.25))
            try:
                await self.sweep_expired()
            except FlagellaError as exc:
                log.warning("expiry sweep failed", extra={"reason": exc.details})

    # --- status ---

    async def status(self) -> Status:
        cidrs, counts = await self.store.usage()
        pools = tuple(
            PoolUsage(node, net, counts.get((node, net.version), 0), capacity_of(net))
            for node in sorted(cidrs)
            for net in cidrs[node]
        )
        cluster = self.settings.mode is Mode.CLUSTER_POOL
        return Status(
            mode=self.settings.mode,
            cluster_cidrs=self.settings.cluster_cidrs if cluster else (),
            node_mask_size_v4=self.settings.node_mask_size_v4 if cluster else 0,
            node_mask_size_v6=self.settings.node_mask_size_v6 if cluster else 0,
            pools=pools,
        )


def _ordered(allocations: Iterable[Allocation]) -> list[Allocation]:
    return sorted(allocations, key=lambda a: sort_key(a.ip))
