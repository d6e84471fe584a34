"""etcd state of the ipam service.

Layout (every key under ``flagella/ipam/v1/``)::

    nodes/<node>                        registration (JSON), bound to the node's own lease
    blocks/<cidr, '/' as '_'>           node name: a pod CIDR belongs to one node only
    pool/cidrs/<node>                   {"cidrs": [...]}: the node's pod CIDRs (no lease)
    pool/ips/<node>/<v4|v6>/<ip>        the allocation: owner, cidr, allocated_at, expires_at
    owners/<node>/<container_id>/<ifname>   {"pod": ..., "ips": [...]}: the owner's index

An IP is taken by creating its ``pool/ips`` key in a transaction that also
writes the owner's index and checks the node's CIDRs did not change; every
change of an owner's allocations compares the index's mod revision, so the
index and the IP keys always move together. Every write is one transaction:
an etcd failure leaves nothing half-written.

Two views follow etcd through the sync layer (flagella.common.sync), each
fed by an EtcdSource started in the runtime's task group: ``nodes`` (a
Table of the registered nodes, which WatchNodes streams from) and the
PoolCache (every node's CIDRs and used addresses from one source over
``pool/``, so that a node's CIDRs always arrive before its IPs). The pool
cache is a hint that keeps allocation O(1): etcd's compares decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flagella.common.errors import Unavailable
from flagella.common.etcd import (
    Etcd,
    KeyValue,
    TxnResult,
    absent,
    delete_op,
    get_op,
    get_prefix_op,
    mod_revision_is,
    prefix_absent,
    prefix_end,
    put_op,
)
from flagella.common.sync import EtcdSource, Subscription, Table
from flagella.common.sync.table import WATCH_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.ipam.model import (
    AddressType,
    Allocation,
    Family,
    Node,
    NodeAddress,
    Owner,
)
from flagella.ipam.pool import IPAddress, IPNetwork, Pool

log = logging.getLogger(__name__)

PREFIX = "flagella/ipam/v1/"
NODES = PREFIX + "nodes/"
BLOCKS = PREFIX + "blocks/"
POOL = PREFIX + "pool/"
CIDRS = POOL + "cidrs/"
IPS = POOL + "ips/"
OWNERS = PREFIX + "owners/"
# Node ids: a small number per node, cluster-wide, kept while the node's
# CIDRs are (across restarts and lease expiry): id -> node and node -> id.
NODE_IDS = PREFIX + "nodeids/"
NODE_ID_OF = PREFIX + "nodeid-of/"
#: Node ids are 1..MAX_NODE_ID (16 bits, as Cilium's).
MAX_NODE_ID = 65535

#: etcd's default limit of operations per transaction (--max-txn-ops).
MAX_TXN_OPS = 128
#: Owners released per transaction by Reconcile (etcd allows 128 operations
#: per transaction; an owner costs up to 5).
OWNERS_PER_TXN = 24


# --- keys ---


def node_key(name: str) -> str:
    return NODES + name


def node_id_key(ident: int) -> str:
    return f"{NODE_IDS}{ident}"


def node_id_of_key(name: str) -> str:
    return NODE_ID_OF + name


def block_key(net: IPNetwork) -> str:
    return BLOCKS + str(net).replace("/", "_")


def cidrs_key(node: str) -> str:
    return CIDRS + node


def ips_prefix(node: str, family: Family | None = None) -> str:
    return f"{IPS}{node}/" + (f"{family.key}/" if family is not None else "")


def ip_key(node: str, ip: IPAddress) -> str:
    return f"{IPS}{node}/{Family.of(ip).key}/{ip}"


def owners_prefix(node: str) -> str:
    return f"{OWNERS}{node}/"


def owner_key(node: str, owner: Owner) -> str:
    return f"{OWNERS}{node}/{owner.container_id}/{owner.ifname}"


def parse_ip_key(key: str) -> tuple[str, IPAddress] | None:
    """(node, ip) of a pool/ips key."""
    if not key.startswith(IPS):
        return None
    parts = key[len(IPS) :].split("/")
    if len(parts) != 3:
        return None
    try:
        return parts[0], ipaddress.ip_address(parts[2])
    except ValueError:
        return None


def parse_owner_key(key: str) -> tuple[str, str, str] | None:
    """(node, container_id, ifname) of an owners key."""
    parts = key[len(OWNERS) :].split("/")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


# --- values ---


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def encode_node(node: Node) -> bytes:
    return _dumps(
        {
            "name": node.name,
            "addresses": [{"type": a.type.value, "ip": a.ip} for a in node.addresses],
            "datapath_address": node.datapath_address,
            "pod_cidrs": [str(c) for c in node.pod_cidrs],
            "labels": node.labels,
            "lease_ttl": node.lease_ttl,
            "registered_at": node.registered_at,
            "id": node.id,
        }
    )


def decode_node(kv: KeyValue) -> Node:
    d = json.loads(kv.value)
    return Node(
        name=d["name"],
        addresses=tuple(NodeAddress(AddressType(a["type"]), a["ip"]) for a in d["addresses"]),
        datapath_address=d["datapath_address"],
        pod_cidrs=tuple(ipaddress.ip_network(c) for c in d["pod_cidrs"]),
        labels=dict(d["labels"]),
        lease_ttl=int(d["lease_ttl"]),
        registered_at=float(d["registered_at"]),
        id=int(d.get("id", 0)),
        revision=kv.mod_revision,
        lease=kv.lease,
    )


def encode_cidrs(cidrs: Sequence[IPNetwork]) -> bytes:
    return _dumps({"cidrs": [str(c) for c in cidrs]})


def decode_cidrs(value: bytes) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(c) for c in json.loads(value)["cidrs"])


def encode_allocation(a: Allocation) -> bytes:
    return _dumps(
        {
            "container_id": a.owner.container_id,
            "ifname": a.owner.ifname,
            "pod": a.owner.pod,
            "cidr": str(a.cidr),
            "allocated_at": a.allocated_at,
            "expires_at": a.expires_at,
        }
    )


def decode_allocation(kv: KeyValue) -> Allocation:
    parsed = parse_ip_key(kv.key)
    if parsed is None:
        raise ValueError(f"not an allocation key: {kv.key}")
    node, ip = parsed
    d = json.loads(kv.value)
    return Allocation(
        ip=ip,
        node=node,
        owner=Owner(d["container_id"], d["ifname"], d.get("pod", "")),
        cidr=ipaddress.ip_network(d["cidr"]),
        allocated_at=float(d["allocated_at"]),
        expires_at=None if d.get("expires_at") is None else float(d["expires_at"]),
        revision=kv.mod_revision,
    )


@dataclass(frozen=True, slots=True)
class OwnerIndex:
    """The owner's list of IPs on a node, with the index key's mod revision."""

    ips: tuple[IPAddress, ...]
    pod: str
    revision: int


def encode_owner_index(ips: Iterable[IPAddress], pod: str) -> bytes:
    return _dumps({"pod": pod, "ips": [str(ip) for ip in ips]})


def decode_owner_index(kv: KeyValue) -> OwnerIndex:
    d = json.loads(kv.value)
    return OwnerIndex(
        ips=tuple(ipaddress.ip_address(ip) for ip in d["ips"]),
        pod=d.get("pod", ""),
        revision=kv.mod_revision,
    )


# --- results ---


@dataclass(frozen=True, slots=True)
class NodeCidrs:
    cidrs: tuple[IPNetwork, ...]
    revision: int


@dataclass(frozen=True, slots=True)
class NodeId:
    """A node's id (nodeid-of/<node>) and that key's revision."""

    id: int
    revision: int


@dataclass(frozen=True, slots=True)
class CreateOutcome:
    """Result of create_allocations: on failure, what etcd held instead."""

    ok: bool
    revision: int
    cidrs: NodeCidrs | None = None
    owner: OwnerIndex | None = None
    # IP -> its key's mod revision, for IPs someone else holds.
    taken: dict[IPAddress, Allocation] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RegisterOutcome:
    ok: bool
    revision: int
    # Blocks another node holds: CIDR -> (node, mod revision).
    conflicts: dict[IPNetwork, tuple[str, int]] = field(default_factory=dict)
    # The node holding the id the registration wanted, when one does.
    id_holder: str | None = None


@dataclass(frozen=True, slots=True)
class OwnerState:
    index: OwnerIndex | None
    allocations: dict[IPAddress, Allocation]


# --- the records of the tables that follow etcd ---


class NodeCodec:
    """nodes/<name> -> the registered Node."""

    def key(self, key: str) -> str | None:
        return key[len(NODES) :] if key.startswith(NODES) else None

    def decode(self, key: str, kv: KeyValue) -> Node | None:
        try:
            return decode_node(kv)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("bad node entry", extra={"key": kv.key, "error": repr(exc)})
            return None


@dataclass(frozen=True, slots=True)
class PoolKey:
    """A key of pool/: a node's CIDRs (ip None) or one of its IPs."""

    node: str
    ip: IPAddress | None = None


@dataclass(frozen=True, slots=True)
class Expiring:
    expires_at: float
    owner: Owner


@dataclass(frozen=True, slots=True)
class UsedIP:
    """An allocated IP as the pool cache needs it: used, and by whom until
    when while it is only reserved."""

    reservation: Expiring | None = None


PoolRecord = NodeCidrs | UsedIP


def decode_reservation(value: bytes) -> Expiring | None:
    """The reservation of an allocation value (None once committed); reads
    only the fields the pool cache needs."""
    d = json.loads(value)
    if d.get("expires_at") is None:
        return None
    return Expiring(float(d["expires_at"]), Owner(d["container_id"], d["ifname"], d.get("pod", "")))


class PoolCodec:
    """pool/cidrs/<node> -> NodeCidrs, pool/ips/<node>/<family>/<ip> -> UsedIP."""

    def key(self, key: str) -> PoolKey | None:
        if key.startswith(CIDRS):
            return PoolKey(key[len(CIDRS) :])
        parsed = parse_ip_key(key)
        return None if parsed is None else PoolKey(*parsed)

    def decode(self, key: PoolKey, kv: KeyValue) -> PoolRecord | None:
        try:
            if key.ip is None:
                return NodeCidrs(decode_cidrs(kv.value), kv.mod_revision)
            return UsedIP(decode_reservation(kv.value))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("bad ipam pool key", extra={"key": kv.key, "error": repr(exc)})
            return None


@dataclass
class _Queued:
    compare: list[Any]
    success: list[Any]
    failure: list[Any]
    keys: frozenset[str]
    future: asyncio.Future[TxnResult]


class TxnBatcher:
    """Group commit of conditional writes: requests queued while a
    transaction is in flight go to etcd together as one transaction (their
    compares and operations concatenated). When that transaction's compares
    fail, each request runs alone with its own failure operations, so every
    caller gets exactly the outcome it would have had alone. Requests whose
    keys overlap never share a transaction (etcd refuses a key written twice).
    """

    def __init__(
        self, etcd: Etcd, *, max_ops: int = MAX_TXN_OPS, tasks: TaskGroup | None = None
    ) -> None:
        self.etcd = etcd
        self.max_ops = max_ops
        # Where the flusher runs (the runtime's group in the service).
        self.tasks = tasks or TaskGroup("ipam-txn")
        self._queue: list[_Queued] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        self.batched = 0

    async def txn(
        self,
        compare: Sequence[Any],
        success: Sequence[Any],
        failure: Sequence[Any],
        keys: Iterable[str],
    ) -> TxnResult:
        """keys: every key the success operations write."""
        item = _Queued(
            list(compare),
            list(success),
            list(failure),
            frozenset(keys),
            asyncio.get_running_loop().create_future(),
        )
        self._queue.append(item)
        if self._flusher is None or self._flusher.done():
            self._flusher = self.tasks.spawn("ipam-txn-batcher", self._flush())
        return await item.future

    def _next_batch(self) -> list[_Queued]:
        batch: list[_Queued] = []
        keys: set[str] = set()
        n_compare = n_success = 0
        rest: list[_Queued] = []
        for item in self._queue:
            fits = (
                n_compare + len(item.compare) <= self.max_ops
                and n_success + len(item.success) <= self.max_ops
                and keys.isdisjoint(item.keys)
            )
            if fits or not batch:
                batch.append(item)
                keys |= item.keys
                n_compare += len(item.compare)
                n_success += len(item.success)
            else:
                rest.append(item)
        self._queue = rest
        return batch

    async def _flush(self) -> None:
        while self._queue:
            # One turn of the event loop lets handlers that are already
            # runnable queue their writes into this batch.
            await asyncio.sleep(0)
            batch = self._next_batch()
            try:
                await self._run(batch)
            except Exception as exc:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)

    async def _run(self, batch: list[_Queued]) -> None:
        if len(batch) > 1:
            result = await self.etcd.txn(
                [c for item in batch for c in item.compare],
                [op for item in batch for op in item.success],
            )
            if result.succeeded:
                self.batches += 1
                self.batched += len(batch)
                for item in batch:
                    if not item.future.done():
                        item.future.set_result(TxnResult(True, result.revision, []))
                return
        outcomes = await asyncio.gather(
            *(self.etcd.txn(item.compare, item.success, item.failure) for item in batch),
            return_exceptions=True,
        )
        for item, outcome in zip(batch, outcomes, strict=True):
            if item.future.done():
                continue
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(outcome)


class IpamStore:
    def __init__(
        self, etcd: Etcd, tasks: TaskGroup, *, watch_history: int = WATCH_LOG_SIZE
    ) -> None:
        self.etcd = etcd
        self.tasks = tasks
        self.batcher = TxnBatcher(etcd, tasks=tasks)
        # (What WatchNodes streams.)
        self.nodes: Table[str, Node] = Table("ipam nodes", log_size=watch_history)
        self.cache = PoolCache(self)
        self._node_source = EtcdSource(etcd, self.nodes, NodeCodec(), prefix=NODES)
        self._pool_source: EtcdSource[PoolKey, PoolRecord] = EtcdSource(
            etcd, self.cache, PoolCodec(), prefix=POOL
        )

    async def start(self) -> None:
        """Follow the node registry and the pools in the background; returns
        once both hold a snapshot."""
        self.tasks.supervise("ipam-nodes", self._node_source.run)
        self.tasks.supervise("ipam-pools", self._pool_source.run)
        await self.nodes.wait_initialized()
        await self.cache.synced.wait()

    # --- node registry ---

    async def get_node(self, name: str) -> tuple[Node, int] | None:
        """The registered node and its lease id."""
        kv = await self.etcd.get(node_key(name))
        return None if kv is None else (decode_node(kv), kv.lease)

    async def get_registration_state(
        self, name: str
    ) -> tuple[tuple[Node, int] | None, NodeCidrs | None, NodeId | None]:
        """The node entry (with its lease), its CIDRs and its id, read together."""
        result = await self.etcd.txn(
            [], [get_op(node_key(name)), get_op(cidrs_key(name)), get_op(node_id_of_key(name))]
        )
        node_kvs, cidr_kvs, id_kvs = result.ranges
        node = (decode_node(node_kvs[0]), node_kvs[0].lease) if node_kvs else None
        cidrs = (
            NodeCidrs(decode_cidrs(cidr_kvs[0].value), cidr_kvs[0].mod_revision)
            if cidr_kvs
            else None
        )
        ident = (
            NodeId(int(json.loads(id_kvs[0].value)["id"]), id_kvs[0].mod_revision)
            if id_kvs
            else None
        )
        return node, cidrs, ident

    async def node_ids(self) -> tuple[dict[int, str], int]:
        """Every node id -> its node."""
        kvs, revision = await self.etcd.get_prefix(NODE_IDS)
        out = {}
        for kv in kvs:
            with contextlib.suppress(ValueError, KeyError):
                out[int(kv.key[len(NODE_IDS) :])] = str(json.loads(kv.value)["node"])
        return out, revision

    async def list_nodes(self) -> tuple[list[Node], int]:
        kvs, revision = await self.etcd.get_prefix(NODES)
        return [decode_node(kv) for kv in kvs], revision

    async def write_registration(
        self,
        node: Node,
        lease: int,
        *,
        node_revision: int,
        cidrs_revision: int,
        new_blocks: Sequence[IPNetwork],
        id_revision: int,
    ) -> RegisterOutcome:
        """Put the node entry on its lease and, with new blocks, the node's
        CIDRs and block locks; a node with no id yet (id_revision 0) takes
        node.id if it is free; all or nothing."""
        compare = [
            mod_revision_is(node_key(node.name), node_revision),
            mod_revision_is(cidrs_key(node.name), cidrs_revision),
            mod_revision_is(node_id_of_key(node.name), id_revision),
            *(absent(block_key(b)) for b in new_blocks),
        ]
        success = [put_op(node_key(node.name), encode_node(node), lease)]
        if not id_revision:
            compare.append(absent(node_id_key(node.id)))
            success += [
                put_op(node_id_key(node.id), _dumps({"node": node.name})),
                put_op(node_id_of_key(node.name), _dumps({"id": node.id})),
            ]
        if new_blocks:
            success.append(put_op(cidrs_key(node.name), encode_cidrs(node.pod_cidrs)))
            success.extend(put_op(block_key(b), node.name.encode()) for b in new_blocks)
        failure = [get_op(block_key(b)) for b in new_blocks]
        if not id_revision:
            failure.append(get_op(node_id_key(node.id)))
        result = await self.etcd.txn(compare, success, failure)
        if result.succeeded:
            return RegisterOutcome(True, result.revision)
        conflicts = {
            b: (kvs[0].value.decode(), kvs[0].mod_revision)
            for b, kvs in zip(new_blocks, result.ranges, strict=False)
            if kvs
        }
        id_holder = None
        if not id_revision and result.ranges[len(new_blocks)]:
            with contextlib.suppress(ValueError, KeyError):
                id_holder = str(json.loads(result.ranges[len(new_blocks)][0].value)["node"])
        return RegisterOutcome(False, result.revision, conflicts, id_holder)

    async def delete_node(
        self,
        name: str,
        *,
        node_revision: int,
        cidrs: NodeCidrs | None,
        ident: NodeId | None = None,
    ) -> tuple[bool, int]:
        """Delete the node entry and, with cidrs, the node's CIDRs and block
        locks provided no allocation and no owner remains, and with ident
        its node id. Returns (ok, the number of allocations left when that
        is what failed)."""
        compare = [mod_revision_is(node_key(name), node_revision)]
        success = [delete_op(node_key(name))]
        if ident is not None:
            compare.append(mod_revision_is(node_id_of_key(name), ident.revision))
            success += [delete_op(node_id_key(ident.id)), delete_op(node_id_of_key(name))]
        failure: list[Any] = []
        if cidrs is not None:
            compare += [
                mod_revision_is(cidrs_key(name), cidrs.revision),
                prefix_absent(ips_prefix(name)),
                prefix_absent(owners_prefix(name)),
            ]
            success.append(delete_op(cidrs_key(name)))
            success.extend(delete_op(block_key(c)) for c in cidrs.cidrs)
        result = await self.etcd.txn(compare, success, failure)
        if result.succeeded:
            return True, 0
        left = 0
        if cidrs is not None:
            left, _ = await self.etcd.count_prefix(ips_prefix(name))
        return False, left

    async def subscribe_nodes(self, since_revision: int) -> Subscription[str, Node]:
        """The node table from since_revision on (0: a snapshot first),
        starting no older than etcd is now, so that a watcher sees every
        registration that completed before it asked. A revision etcd
        compacted gets a snapshot, whichever replica is asked (as a watch of
        etcd from it would)."""
        head = await self.etcd.current_revision()
        if 0 < since_revision <= head and await self._compacted(since_revision):
            since_revision = 0
        try:
            await self.nodes.wait_for(head, self.etcd.timeout)
        except TimeoutError:
            raise Unavailable(
                f"the node registry did not catch up with etcd ({self.nodes.reason})"
            ) from None
        return self.nodes.subscribe(since_revision)

    async def _compacted(self, revision: int) -> bool:
        """Whether etcd can no longer read the registry at revision (a
        range compared with itself is unchanged unless it is unreadable)."""
        end = prefix_end(NODES)
        return not await self.etcd.range_unchanged(NODES, end, revision, revision)

    # --- leases ---

    async def grant_lease(self, ttl: int) -> int:
        return await self.etcd.grant_lease(ttl)

    async def keepalive(self, lease: int) -> int:
        return await self.etcd.keepalive_once(lease)

    async def revoke_lease(self, lease: int) -> None:
        await self.etcd.revoke_lease(lease)

    # --- CIDRs ---

    async def get_cidrs(self, node: str) -> NodeCidrs | None:
        kv = await self.etcd.get(cidrs_key(node))
        return None if kv is None else NodeCidrs(decode_cidrs(kv.value), kv.mod_revision)

    async def read_pool(self, node: str, family: Family) -> tuple[list[IPAddress], int]:
        """Every allocated IP of one family of a node (keys only), and the
        revision of the read."""
        kvs, revision = await self.etcd.get_prefix(ips_prefix(node, family), keys_only=True)
        ips = [p[1] for p in (parse_ip_key(kv.key) for kv in kvs) if p is not None]
        return ips, revision

    async def count_pool(self, node: str, family: Family) -> tuple[int, int]:
        return await self.etcd.count_prefix(ips_prefix(node, family))

    # --- allocations ---

    async def create_allocations(
        self,
        node: str,
        owner: Owner,
        new: Sequence[Allocation],
        *,
        cidrs_revision: int,
        owner_index: OwnerIndex | None,
    ) -> CreateOutcome:
        """Create the IP keys of new and the owner's index (its IPs plus the
        new ones) in one transaction, if the node's CIDRs, the owner's index
        and the new IPs are as expected (absent)."""
        okey = owner_key(node, owner)
        keys = [ip_key(node, a.ip) for a in new]
        held = owner_index.ips if owner_index is not None else ()
        compare = [
            mod_revision_is(cidrs_key(node), cidrs_revision),
            mod_revision_is(okey, owner_index.revision if owner_index is not None else 0),
            *(absent(k) for k in keys),
        ]
        success = [
            *(put_op(k, encode_allocation(a)) for k, a in zip(keys, new, strict=True)),
            put_op(okey, encode_owner_index([*held, *(a.ip for a in new)], owner.pod)),
        ]
        failure = [get_op(cidrs_key(node)), get_op(okey), *(get_op(k) for k in keys)]
        result = await self.batcher.txn(compare, success, failure, [okey, *keys])
        if result.succeeded:
            return CreateOutcome(True, result.revision)
        cidr_kvs, owner_kvs, *ip_kvs = result.ranges
        return CreateOutcome(
            False,
            result.revision,
            cidrs=(
                NodeCidrs(decode_cidrs(cidr_kvs[0].value), cidr_kvs[0].mod_revision)
                if cidr_kvs
                else None
            ),
            owner=decode_owner_index(owner_kvs[0]) if owner_kvs else None,
            taken={
                a.ip: decode_allocation(kvs[0]) for a, kvs in zip(new, ip_kvs, strict=True) if kvs
            },
        )

    async def get_allocation(self, node: str, ip: IPAddress) -> Allocation | None:
        kv = await self.etcd.get(ip_key(node, ip))
        return None if kv is None else decode_allocation(kv)

    async def get_allocations(self, node: str, ips: Sequence[IPAddress]) -> list[Allocation]:
        if not ips:
            return []
        result = await self.etcd.txn([], [get_op(ip_key(node, ip)) for ip in ips])
        return [decode_allocation(kvs[0]) for kvs in result.ranges if kvs]

    async def get_owner_index(self, node: str, owner: Owner) -> OwnerIndex | None:
        kv = await self.etcd.get(owner_key(node, owner))
        return None if kv is None else decode_owner_index(kv)

    async def load_owner(self, node: str, owner: Owner) -> OwnerState:
        """The owner's index and its allocations (two reads; writes based on
        it compare every mod revision)."""
        index = await self.get_owner_index(node, owner)
        if index is None:
            return OwnerState(None, {})
        allocations = await self.get_allocations(node, index.ips)
        return OwnerState(index, {a.ip: a for a in allocations})

    async def update_owner(
        self,
        node: str,
        owner: Owner,
        state: OwnerState,
        *,
        put: Sequence[Allocation] = (),
        delete: Sequence[IPAddress] = (),
    ) -> tuple[bool, int]:
        """Rewrite or delete some of the owner's allocations, and its index,
        if nothing changed since state was read."""
        okey = owner_key(node, owner)
        compare = [
            mod_revision_is(okey, state.index.revision if state.index is not None else 0),
            *(mod_revision_is(ip_key(node, ip), a.revision) for ip, a in state.allocations.items()),
        ]
        gone = set(delete)
        remaining = [ip for ip in (state.index.ips if state.index else ()) if ip not in gone]
        pod = state.index.pod if state.index is not None else owner.pod
        success = [
            *(put_op(ip_key(node, a.ip), encode_allocation(a)) for a in put),
            *(delete_op(ip_key(node, ip)) for ip in delete),
            put_op(okey, encode_owner_index(remaining, pod)) if remaining else delete_op(okey),
        ]
        result = await self.etcd.txn(compare, success)
        return result.succeeded, result.revision

    async def list_owners(self, node: str) -> list[tuple[Owner, OwnerIndex]]:
        kvs, _ = await self.etcd.get_prefix(owners_prefix(node))
        out = []
        for kv in kvs:
            parsed = parse_owner_key(kv.key)
            if parsed is None:
                continue
            index = decode_owner_index(kv)
            out.append((Owner(parsed[1], parsed[2], index.pod), index))
        return out

    async def delete_owners(
        self, node: str, owners: Sequence[tuple[Owner, OwnerIndex]]
    ) -> list[Allocation] | None:
        """Release every allocation of these owners in one transaction if no
        index changed; returns what was released, None on a conflict."""
        compare = [mod_revision_is(owner_key(node, o), idx.revision) for o, idx in owners]
        ips = [ip for _, idx in owners for ip in idx.ips]
        success = [
            *(get_op(ip_key(node, ip)) for ip in ips),
            *(delete_op(ip_key(node, ip)) for ip in ips),
            *(delete_op(owner_key(node, o)) for o, _ in owners),
        ]
        result = await self.etcd.txn(compare, success)
        if not result.succeeded:
            return None
        return [decode_allocation(kvs[0]) for kvs in result.ranges if kvs]

    async def list_allocations(
        self, node: str | None, family: Family | None
    ) -> tuple[list[Allocation], int]:
        prefix = IPS if node is None else ips_prefix(node, family)
        kvs, revision = await self.etcd.get_prefix(prefix)
        allocations = [decode_allocation(kv) for kv in kvs]
        if family is not None and node is None:
            allocations = [a for a in allocations if a.family is family]
        return allocations, revision

    async def usage(self) -> tuple[dict[str, tuple[IPNetwork, ...]], dict[tuple[str, int], int]]:
        """Every node's CIDRs and the count of allocations per (node, IP
        version), read at one revision."""
        result = await self.etcd.txn([], [get_prefix_op(CIDRS), get_prefix_op(IPS, keys_only=True)])
        cidr_kvs, ip_kvs = result.ranges
        cidrs = {kv.key[len(CIDRS) :]: decode_cidrs(kv.value) for kv in cidr_kvs}
        counts: dict[tuple[str, int], int] = {}
        for kv in ip_kvs:
            parsed = parse_ip_key(kv.key)
            if parsed is not None:
                k = (parsed[0], parsed[1].version)
                counts[k] = counts.get(k, 0) + 1
        return cidrs, counts


# --- the in-memory view of pools ---


@dataclass
class NodePools:
    """One node's CIDRs (with the cidrs key's mod revision) and a Pool per
    family."""

    cidrs: tuple[IPNetwork, ...]
    revision: int
    pools: dict[Family, Pool]

    @classmethod
    def build(
        cls, cidrs: tuple[IPNetwork, ...], revision: int, old: NodePools | None = None
    ) -> NodePools:
        pools = {}
        for net in cidrs:
            fam = Family.of(net)
            prev = old.pools.get(fam) if old is not None else None
            pools[fam] = prev if prev is not None and prev.network == net else Pool(net)
        return cls(cidrs, revision, pools)

    def pool_of(self, ip: IPAddress) -> Pool | None:
        pool = self.pools.get(Family.of(ip))
        if pool is None or pool.offset_of(ip) is None:
            return None
        return pool


class PoolCache:
    """Every node's CIDRs and used addresses as this replica last saw them
    through one EtcdSource over ``pool/`` (the cache is its sink: each watch
    event is applied as it comes, in order), plus reservations that will
    expire."""

    def __init__(self, store: IpamStore) -> None:
        self.store = store
        self.codec = PoolCodec()
        self.nodes: dict[str, NodePools] = {}
        # (node, ip) -> reservation expiry, for the expiry sweep.
        self.expiring: dict[tuple[str, IPAddress], Expiring] = {}
        # Revision of the last event applied.
        self.revision = 0
        self.synced = asyncio.Event()
        self.live = False
        self._resync_locks: dict[tuple[str, Family], asyncio.Lock] = {}

    # --- the sink the EtcdSource feeds ---

    def get(self, key: PoolKey) -> PoolRecord | None:
        entry = self.nodes.get(key.node)
        if key.ip is None:
            return None if entry is None else NodeCidrs(entry.cidrs, entry.revision)
        reservation = self.expiring.get((key.node, key.ip))
        if reservation is not None:
            return UsedIP(reservation)
        pool = entry.pool_of(key.ip) if entry is not None else None
        return UsedIP() if pool is not None and pool.offset_of(key.ip) in pool.used else None

    def replace(self, records: Iterable[tuple[PoolKey, PoolRecord, int]], revision: int) -> None:
        """A full read of pool/ at revision: every pool is rebuilt from it."""
        records = list(records)
        old = self.nodes
        nodes: dict[str, NodePools] = {}
        for key, record, _ in records:
            if isinstance(record, NodeCidrs):
                nodes[key.node] = NodePools.build(record.cidrs, record.revision, old.get(key.node))
        for entry in nodes.values():
            for pool in entry.pools.values():
                pool.replace_used((), revision)
        self.nodes = nodes
        self.expiring = {}
        for key, record, key_revision in records:
            if key.ip is not None and isinstance(record, UsedIP):
                self._apply_ip(key.node, key.ip, record, key_revision, gate=False)
        self.revision = revision
        self.synced.set()
        log.info(
            "ipam pools synced",
            extra={"revision": revision, "nodes": len(nodes), "keys": len(records)},
        )

    def commit(
        self, updates: Iterable[tuple[PoolKey, PoolRecord | None, int]], revision: int
    ) -> None:
        """Watch events, in order (None: the key is gone)."""
        self.revision = max(self.revision, revision)
        for key, record, key_revision in updates:
            if key.ip is None:
                self._apply_cidrs(key.node, record, key_revision)
            else:
                used = record if isinstance(record, UsedIP) else None
                self._apply_ip(key.node, key.ip, used, key_revision, gate=True)

    def advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)

    def set_live(self, live: bool, reason: str = "") -> None:
        # A hint either way: allocation goes on while the watch is away.
        self.live = live

    def apply(self, put: bool, kv: KeyValue) -> None:
        """One watch event."""
        key = self.codec.key(kv.key)
        if key is not None:
            record = self.codec.decode(key, kv) if put else None
            self.commit([(key, record, kv.mod_revision)], kv.mod_revision)

    def _apply_cidrs(self, name: str, record: PoolRecord | None, revision: int) -> None:
        entry = self.nodes.get(name)
        if entry is not None and revision <= entry.revision:
            return
        if isinstance(record, NodeCidrs):
            self.nodes[name] = NodePools.build(record.cidrs, revision, entry)
        else:
            self.nodes.pop(name, None)

    def _apply_ip(
        self, node: str, ip: IPAddress, record: UsedIP | None, revision: int, *, gate: bool
    ) -> None:
        if record is not None and record.reservation is not None:
            self.expiring[(node, ip)] = record.reservation
        else:
            self.expiring.pop((node, ip), None)
        entry = self.nodes.get(node)
        pool = entry.pool_of(ip) if entry is not None else None
        if pool is None:
            return
        if gate and revision <= pool.synced_revision:
            return  # a full read of the pool already reflects it
        off = pool.offset_of(ip)
        assert off is not None
        if record is not None:
            pool.mark_used(off)
        else:
            pool.mark_free(off)

    def learn_used(self, pool: Pool, ip: IPAddress, mod_revision: int) -> None:
        """An IP key that exists at mod_revision (our own write, or someone
        else's found by a failed compare): mark it used now unless the watch
        or a full read already went past it."""
        if max(self.revision, pool.synced_revision) < mod_revision:
            off = pool.offset_of(ip)
            if off is not None:
                pool.mark_used(off)

    def set_node(self, name: str, cidrs: NodeCidrs | None) -> NodePools | None:
        """Install a node's CIDRs read from etcd directly (newer than the
        watch)."""
        entry = self.nodes.get(name)
        if cidrs is None:
            if entry is not None:
                del self.nodes[name]
            return None
        if entry is not None and entry.revision >= cidrs.revision:
            return entry
        entry = NodePools.build(cidrs.cidrs, cidrs.revision, entry)
        self.nodes[name] = entry
        return entry

    async def resync_pool(self, node: str, family: Family, min_revision: int) -> None:
        """Read a pool's used IPs from etcd (coalesced: one read serves every
        caller that needs a view at least as new as min_revision)."""
        lock = self._resync_locks.setdefault((node, family), asyncio.Lock())
        async with lock:
            entry = self.nodes.get(node)
            pool = entry.pools.get(family) if entry is not None else None
            if pool is None or pool.synced_revision >= min_revision:
                return
            ips, revision = await self.store.read_pool(node, family)
            offsets = [off for off in (pool.offset_of(ip) for ip in ips) if off is not None]
            pool.replace_used(offsets, revision)

    def assigned_cidrs(self) -> dict[IPNetwork, str]:
        return {cidr: name for name, entry in self.nodes.items() for cidr in entry.cidrs}

    def expired(self, now: float) -> dict[tuple[str, Owner], list[IPAddress]]:
        """Reservations past their expiry, by (node, owner)."""
        out: dict[tuple[str, Owner], list[IPAddress]] = {}
        for (node, ip), exp in self.expiring.items():
            if exp.expires_at <= now:
                out.setdefault((node, exp.owner), []).append(ip)
        return out
