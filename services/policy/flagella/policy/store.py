"""etcd state of the policy service: every read and transaction, on the
layout of flagella.policy.keys. Multi-key changes are single transactions,
so a crash never leaves half of one behind."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from flagella.common.etcd import (
    Etcd,
    EventType,
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
from flagella.policy import keys
from flagella.policy.rules import Rule, rule_to_json

# How many times an operation tries a transaction that lost a race before it
# answers Unavailable (the caller may retry).
MAX_ATTEMPTS = 64


@dataclass(frozen=True, slots=True)
class Event:
    """A watch event on the mirrored range."""

    deleted: bool
    kv: KeyValue

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


@dataclass(frozen=True, slots=True)
class NodeLease:
    node: str
    lease: int
    record_key: str
    record_revision: int


def _node_guard(lease: NodeLease | None) -> list[object]:
    """Compare: the node's lease record still exists (so the lease is alive)."""
    if lease is None:
        return []
    return [mod_revision_is(lease.record_key, lease.record_revision)]


class PolicyStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd

    # --- mirror ---

    async def snapshot(self, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every mirrored key at one revision (0: now)."""
        lists, rev = await self.etcd.get_prefixes(keys.MIRRORED_PREFIXES, revision=revision)
        return [kv for lst in lists for kv in lst], rev

    async def watch(self, start_revision: int) -> AsyncIterator[Event]:
        """Changes to the mirrored keys from start_revision on."""
        async for event in self.etcd.watch_range(
            keys.RULES_PREFIX, prefix_end(keys.IP_PREFIX), start_revision
        ):
            if keys.parse_key(event.kv.key).kind:
                yield Event(event.type is EventType.DELETE, event.kv)

    # --- node leases ---

    async def grant_node_lease(self, node: str, ttl: int, replica: str) -> NodeLease:
        lease = await self.etcd.grant_lease(ttl)
        key = keys.node_lease_key(node, lease)
        result = await self.etcd.txn(
            [absent(key)], [put_op(key, keys.dumps({"ttl": ttl, "by": replica}), lease)]
        )
        return NodeLease(node, lease, key, result.revision)

    async def keepalive(self, lease: int) -> int:
        return await self.etcd.keepalive_once(lease)

    async def revoke(self, lease: int) -> None:
        await self.etcd.revoke_lease(lease)

    # --- identities ---

    async def create_identity(
        self,
        ident: int,
        labels: str,
        label_list: Sequence[str],
        node: NodeLease | None,
        owner: str = "",
    ) -> TxnResult:
        """Creates id/<ident> and labels/<labels> and the node's first
        reference (owner's, or the anonymous count when owner is empty), if
        neither exists (and the node's lease is alive). On failure, ranges
        are [labels/<labels>, id/<ident>]."""
        labels_key = keys.labels_key(labels)
        id_key = keys.id_key(ident)
        ops = [
            put_op(id_key, keys.dumps({"labels": list(label_list)})),
            put_op(labels_key, keys.dumps({"id": ident})),
        ]
        if node is not None and owner:
            ops.append(
                put_op(
                    keys.owner_key(labels, node.node, owner),
                    keys.dumps({"id": ident}),
                    node.lease,
                )
            )
        elif node is not None:
            ops.append(
                put_op(
                    keys.ref_key(labels, node.node),
                    keys.dumps({"id": ident, "refs": 1}),
                    node.lease,
                )
            )
        return await self.etcd.txn(
            [absent(labels_key), absent(id_key), *_node_guard(node)],
            ops,
            [get_op(labels_key), get_op(id_key)],
        )

    async def set_reference(
        self,
        labels: str,
        ident: int,
        node: str,
        refs: int,
        *,
        guard: NodeLease | None,
        ref_revision: int,
        lease: int,
        labels_revision: int | None,
    ) -> TxnResult:
        """Sets node's anonymous reference count on an identity, if the
        count is still at ref_revision (0: absent), the identity still maps
        the labels (labels key at labels_revision; None for reserved ids) and
        the guard lease of the node is alive. The count keeps its lease, or
        takes the guard's when new. refs 0 deletes it; then, on success,
        ranges are [one key of an owner's reference of node, if any]. On
        failure, ranges are [labels/<labels>, value/<labels>/<node>]."""
        ref_key = keys.ref_key(labels, node)
        labels_key = keys.labels_key(labels)
        compare = [mod_revision_is(ref_key, ref_revision)]
        if labels_revision is not None:
            compare.append(mod_revision_is(labels_key, labels_revision))
        if refs > 0:
            compare += _node_guard(guard)
            if not lease and guard is not None:
                lease = guard.lease
            ops = [put_op(ref_key, keys.dumps({"id": ident, "refs": refs}), lease)]
        else:
            ops = [
                get_prefix_op(keys.owners_prefix(labels, node), limit=1, keys_only=True),
                delete_op(ref_key),
            ]
        return await self.etcd.txn(compare, ops, [get_op(labels_key), get_op(ref_key)])

    async def take_owned_reference(
        self,
        labels: str,
        ident: int,
        node: str,
        owner: str,
        *,
        held_revision: int,
        guard: NodeLease | None,
        labels_revision: int | None,
    ) -> TxnResult:
        """Owner's reference of node on an identity. held_revision 0: takes
        it (one new key on the guard's lease), if the owner holds none, the
        identity still maps the labels (labels key at labels_revision; None
        for reserved ids) and the guard lease is alive. Otherwise: checks,
        writing nothing, that the owner's reference is still the one at
        held_revision (and the identity still maps the labels). On failure,
        ranges are [labels/<labels>, the owner's reference]."""
        key = keys.owner_key(labels, node, owner)
        labels_key = keys.labels_key(labels)
        compare = [mod_revision_is(key, held_revision)]
        if labels_revision is not None:
            compare.append(mod_revision_is(labels_key, labels_revision))
        ops = []
        if not held_revision:
            if guard is None:
                raise ValueError("a new reference needs the node's lease")
            compare += _node_guard(guard)
            ops.append(put_op(key, keys.dumps({"id": ident}), guard.lease))
        return await self.etcd.txn(compare, ops, [get_op(labels_key), get_op(key)])

    async def drop_owned_reference(
        self, labels: str, node: str, owner: str, *, revision: int
    ) -> TxnResult:
        """Deletes owner's reference of node on the identity of labels if it
        is still at revision. On success, ranges are [the node's anonymous
        count, up to two keys of owners' references of node (the owner's
        own among them, as they were before the delete)]; on failure, [the
        owner's reference]."""
        key = keys.owner_key(labels, node, owner)
        return await self.etcd.txn(
            [mod_revision_is(key, revision)],
            [
                get_op(keys.ref_key(labels, node)),
                get_prefix_op(keys.owners_prefix(labels, node), limit=2, keys_only=True),
                delete_op(key),
            ],
            [get_op(key)],
        )

    async def get_owned_reference(self, labels: str, node: str, owner: str) -> KeyValue | None:
        return await self.etcd.get(keys.owner_key(labels, node, owner))

    async def get_reference(self, labels: str, node: str) -> KeyValue | None:
        return await self.etcd.get(keys.ref_key(labels, node))

    async def get_identity(self, ident: int) -> KeyValue | None:
        return await self.etcd.get(keys.id_key(ident))

    async def get_labels(self, labels: str) -> KeyValue | None:
        return await self.etcd.get(keys.labels_key(labels))

    async def delete_identity(
        self, ident: int, labels: str, *, id_revision: int, labels_revision: int
    ) -> bool:
        """Garbage-collects an identity: only if no node references it
        (no anonymous count, no owner's reference) and neither key changed
        since it was seen unreferenced."""
        result = await self.etcd.txn(
            [
                prefix_absent(keys.ref_prefix(labels)),
                mod_revision_is(keys.id_key(ident), id_revision),
                mod_revision_is(keys.labels_key(labels), labels_revision),
            ],
            [delete_op(keys.id_key(ident)), delete_op(keys.labels_key(labels))],
        )
        return result.succeeded

    # --- ipcache ---

    async def put_ip(self, prefix: str, value: bytes, node: NodeLease | None) -> TxnResult:
        return await self.etcd.txn(
            _node_guard(node), [put_op(keys.ip_key(prefix), value, node.lease if node else 0)]
        )

    async def get_ip(self, prefix: str) -> KeyValue | None:
        return await self.etcd.get(keys.ip_key(prefix))

    async def delete_ip(self, prefix: str, *, revision: int) -> TxnResult:
        key = keys.ip_key(prefix)
        return await self.etcd.txn([mod_revision_is(key, revision)], [delete_op(key)])

    # --- rules ---

    async def put_rules(self, rules: Sequence[Rule]) -> int:
        """All rules in one transaction; returns its revision."""
        result = await self.etcd.txn(
            [], [put_op(keys.rule_key(r.key), rule_to_json(r)) for r in rules]
        )
        return result.revision

    async def delete_rule(self, name: str) -> tuple[bool, int]:
        key = keys.rule_key(name)
        result = await self.etcd.txn([absent(key)], [], [delete_op(key)])
        return (not result.succeeded), result.revision
