"""etcd state of the policy service: every read and transaction, on the
layout of flagella.policy.keys. Multi-key changes are single transactions,
so a crash never leaves half of one behind.

Reads and transactions answer in the typed records and outcomes of
flagella.policy.outcomes: keys, etcd values and transaction results stay in
this module (the mirror, which decodes every key it follows, gets the raw
key-values of snapshot and watch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
from flagella.common.sync import EtcdSource, Sink
from flagella.policy import keys
from flagella.policy.labels import Label, label_set
from flagella.policy.outcomes import (
    CreateOutcome,
    DropOutcome,
    FqdnDeleted,
    FqdnMoved,
    FqdnStored,
    IdentityCreated,
    IdTaken,
    IPEntryStored,
    LabelsEntry,
    LabelsMoved,
    LabelsTaken,
    LeaseLost,
    NodeLease,
    Reference,
    ReferenceDropped,
    ReferenceMoved,
    ReferenceTaken,
    StoredIdentity,
    TakeOutcome,
)
from flagella.policy.rules import CIDRGroup, Rule, cidr_group_to_json, rule_to_json
from flagella.policy.state import (
    FqdnEntry,
    IPEntry,
    fqdn_entry_json,
    named_ports_from_json,
    named_ports_json,
)

# How many times an operation tries a transaction that lost a race before it
# answers Unavailable (the caller may retry).
MAX_ATTEMPTS = 64


class _MirroredKeys:
    """The mirror's codec: the keys flagella.policy.keys knows, raw."""

    def key(self, key: str) -> str | None:
        return key if keys.parse_key(key).kind else None

    def decode(self, key: str, kv: KeyValue) -> KeyValue:
        return kv


# --- decoding ---


def _first(result: TxnResult, index: int) -> KeyValue | None:
    """The first key-value of the index-th read of a transaction."""
    if index < len(result.ranges) and result.ranges[index]:
        return result.ranges[index][0]
    return None


def _labels_entry(kv: KeyValue | None) -> LabelsEntry | None:
    if kv is None:
        return None
    return LabelsEntry(int(keys.loads(kv.value)["id"]), kv.mod_revision)


def _reference(kv: KeyValue | None) -> Reference | None:
    """An anonymous count ({"id", "refs"}) or an owner's reference ({"id"})."""
    if kv is None:
        return None
    value = keys.loads(kv.value)
    return Reference(int(value["id"]), int(value.get("refs", 1)), kv.mod_revision, kv.lease)


def _node_guard(lease: NodeLease | None) -> list[object]:
    """Compare: the node's lease record still exists (so the lease is alive)."""
    if lease is None:
        return []
    return [mod_revision_is(lease.record_key, lease.record_revision)]


def _revision_of(ref: Reference | None) -> int:
    return ref.revision if ref is not None else 0


def _take_failed(
    result: TxnResult, *, held: Reference | None, labels_revision: int | None
) -> LabelsMoved | ReferenceMoved | LeaseLost:
    """Which compare of a reference write failed, from its reads
    [labels/<labels>, the reference]: the labels' (checked when
    labels_revision is given), the reference's, or else the lease's."""
    labels_kv = _first(result, 0)
    ref = _reference(_first(result, 1))
    if labels_revision is not None and (
        labels_kv is None or labels_kv.mod_revision != labels_revision
    ):
        return LabelsMoved(_labels_entry(labels_kv), ref)
    if _revision_of(ref) != _revision_of(held):
        return ReferenceMoved(ref)
    return LeaseLost()


class PolicyStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd

    # --- mirror ---

    def mirror_source(self, sink: Sink[str, KeyValue]) -> EtcdSource[str, KeyValue]:
        """What keeps a replica's mirror in step: every mirrored key, as its
        raw key-value (the mirror decodes them), read in pages at one
        revision and watched as one key range [CIDR_GROUPS_PREFIX, end of
        IP_PREFIX) (keys of others in between are ignored)."""
        return EtcdSource(
            self.etcd,
            sink,
            _MirroredKeys(),
            start=keys.CIDR_GROUPS_PREFIX,
            range_end=prefix_end(keys.IP_PREFIX),
            name="policy",
        )

    # --- node leases (flagella.policy.leases) ---

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
        lease: NodeLease,
        owner: str = "",
    ) -> CreateOutcome:
        """Creates id/<ident> and labels/<labels> and the node's first
        reference (owner's, or the anonymous count when owner is empty), if
        neither exists and the node's lease is alive."""
        labels_key = keys.labels_key(labels)
        id_key = keys.id_key(ident)
        if owner:
            ref_key = keys.owner_key(labels, lease.node, owner)
            ref_value = keys.dumps({"id": ident})
        else:
            ref_key = keys.ref_key(labels, lease.node)
            ref_value = keys.dumps({"id": ident, "refs": 1})
        result = await self.etcd.txn(
            [absent(labels_key), absent(id_key), *_node_guard(lease)],
            [
                put_op(id_key, keys.dumps({"labels": list(label_list)})),
                put_op(labels_key, keys.dumps({"id": ident})),
                put_op(ref_key, ref_value, lease.lease),
            ],
            [get_op(labels_key), get_op(id_key), get_op(ref_key)],
        )
        if result.succeeded:
            return IdentityCreated(result.revision)
        taken = _labels_entry(_first(result, 0))
        if taken is not None:
            return LabelsTaken(taken, _reference(_first(result, 2)))
        if _first(result, 1) is not None:
            return IdTaken()
        return LeaseLost()

    async def add_reference(
        self,
        labels: str,
        ident: int,
        lease: NodeLease,
        *,
        held: Reference | None,
        labels_revision: int | None,
    ) -> TakeOutcome:
        """One more anonymous reference of the node on an identity: its
        count becomes held's + 1 (1 when held is None), if the count is
        still held, the identity still maps the labels (labels key at
        labels_revision; None for reserved ids) and the node's lease is
        alive. A count keeps its lease; a new one takes the node's."""
        ref_key = keys.ref_key(labels, lease.node)
        labels_key = keys.labels_key(labels)
        compare = [mod_revision_is(ref_key, _revision_of(held))]
        if labels_revision is not None:
            compare.append(mod_revision_is(labels_key, labels_revision))
        compare += _node_guard(lease)
        refs = held.refs + 1 if held is not None else 1
        bound = held.lease if held is not None and held.lease else lease.lease
        result = await self.etcd.txn(
            compare,
            [put_op(ref_key, keys.dumps({"id": ident, "refs": refs}), bound)],
            [get_op(labels_key), get_op(ref_key)],
        )
        if result.succeeded:
            return ReferenceTaken(result.revision)
        return _take_failed(result, held=held, labels_revision=labels_revision)

    async def take_owned_reference(
        self,
        labels: str,
        ident: int,
        node: str,
        owner: str,
        *,
        held: Reference | None,
        lease: NodeLease | None,
        labels_revision: int | None,
    ) -> TakeOutcome:
        """Owner's reference of node on an identity. held None: takes it
        (one new key on the node's lease), if the owner holds none, the
        identity still maps the labels (labels key at labels_revision; None
        for reserved ids) and the lease is alive. Otherwise: checks, writing
        nothing, that the owner's reference is still held (and the identity
        still maps the labels)."""
        key = keys.owner_key(labels, node, owner)
        labels_key = keys.labels_key(labels)
        compare = [mod_revision_is(key, _revision_of(held))]
        if labels_revision is not None:
            compare.append(mod_revision_is(labels_key, labels_revision))
        ops = []
        if held is None:
            if lease is None:
                raise ValueError("a new reference needs the node's lease")
            compare += _node_guard(lease)
            ops.append(put_op(key, keys.dumps({"id": ident}), lease.lease))
        result = await self.etcd.txn(compare, ops, [get_op(labels_key), get_op(key)])
        if result.succeeded:
            return ReferenceTaken(result.revision)
        return _take_failed(result, held=held, labels_revision=labels_revision)

    async def drop_reference(
        self, labels: str, ident: int, node: str, *, held: Reference
    ) -> DropOutcome:
        """One anonymous reference fewer of node on an identity: its count
        becomes held's - 1 (deleted at 0, keeping its lease otherwise), if
        it is still held."""
        ref_key = keys.ref_key(labels, node)
        refs = held.refs - 1
        if refs > 0:
            ops = [put_op(ref_key, keys.dumps({"id": ident, "refs": refs}), held.lease)]
        else:
            ops = [
                get_prefix_op(keys.owners_prefix(labels, node), limit=1, keys_only=True),
                delete_op(ref_key),
            ]
        result = await self.etcd.txn(
            [mod_revision_is(ref_key, held.revision)], ops, [get_op(ref_key)]
        )
        if not result.succeeded:
            return ReferenceMoved(_reference(_first(result, 0)))
        # At 0, the read before the delete: an owner's reference of node.
        last = refs <= 0 and _first(result, 0) is None
        return ReferenceDropped(result.revision, last)

    async def drop_owned_reference(
        self, labels: str, node: str, owner: str, *, held: Reference
    ) -> DropOutcome:
        """Deletes owner's reference of node on the identity of labels if it
        is still held."""
        key = keys.owner_key(labels, node, owner)
        result = await self.etcd.txn(
            [mod_revision_is(key, held.revision)],
            [
                get_op(keys.ref_key(labels, node)),
                # up to two: the owner's own (read before the delete) and another
                get_prefix_op(keys.owners_prefix(labels, node), limit=2, keys_only=True),
                delete_op(key),
            ],
            [get_op(key)],
        )
        if not result.succeeded:
            return ReferenceMoved(_reference(_first(result, 0)))
        anonymous = _first(result, 0)
        others = [kv for kv in result.ranges[1] if kv.key != key]
        return ReferenceDropped(result.revision, anonymous is None and not others)

    async def get_reference(self, labels: str, node: str, owner: str = "") -> Reference | None:
        """The node's anonymous count on the identity of labels, or the
        owner's reference when owner is given."""
        key = keys.owner_key(labels, node, owner) if owner else keys.ref_key(labels, node)
        return _reference(await self.etcd.get(key))

    async def get_identity(self, ident: int) -> StoredIdentity | None:
        kv = await self.etcd.get(keys.id_key(ident))
        if kv is None:
            return None
        labels = label_set(Label.parse(t) for t in keys.loads(kv.value)["labels"])
        return StoredIdentity(ident, labels, kv.mod_revision)

    async def get_labels(self, labels: str) -> LabelsEntry | None:
        return _labels_entry(await self.etcd.get(keys.labels_key(labels)))

    async def delete_identity(
        self, ident: int, labels: str, *, id_revision: int, labels_revision: int
    ) -> bool:
        """Garbage-collects an identity: only if no node references it
        (no anonymous count, no owner's reference) and neither key changed
        since it was seen unreferenced."""
        compare, ops = _delete_identity_ops(ident, labels, id_revision, labels_revision)
        result = await self.etcd.txn(compare, ops)
        return result.succeeded

    async def delete_identities(self, due: Sequence[IdentityToDelete]) -> list[bool]:
        """delete_identity() of each, in one transaction when none changed
        (under churn a GC round frees thousands: one transaction each was
        a third of the transactions per churned pod); when the transaction
        fails (one was referenced or changed meanwhile), one by one, so
        that each gets its own outcome."""
        if len(due) > 1:
            compare: list[Any] = []
            ops: list[Any] = []
            for d in due:
                c, o = _delete_identity_ops(d.id, d.labels, d.id_revision, d.labels_revision)
                compare += c
                ops += o
            if (await self.etcd.txn(compare, ops)).succeeded:
                return [True] * len(due)
        return [
            await self.delete_identity(
                d.id, d.labels, id_revision=d.id_revision, labels_revision=d.labels_revision
            )
            for d in due
        ]

    # --- ipcache ---

    async def put_ip(self, entry: IPEntry, lease: NodeLease | None) -> IPEntryStored | LeaseLost:
        """Puts entry (on the node's lease when given, if it is alive)."""
        value = keys.dumps(
            {
                "identity": entry.identity,
                "node": entry.node,
                "hostIP": entry.host_ip,
                "source": entry.source,
                **named_ports_json(entry.named_ports),
            }
        )
        result = await self.etcd.txn(
            _node_guard(lease),
            [put_op(keys.ip_key(entry.prefix), value, lease.lease if lease else 0)],
        )
        return IPEntryStored(result.revision) if result.succeeded else LeaseLost()

    async def get_ip(self, prefix: str) -> IPEntry | None:
        kv = await self.etcd.get(keys.ip_key(prefix))
        if kv is None:
            return None
        value = keys.loads(kv.value)
        return IPEntry(
            prefix=prefix,
            identity=int(value["identity"]),
            node=value.get("node", ""),
            host_ip=value.get("hostIP", ""),
            source=value.get("source", ""),
            revision=kv.mod_revision,
            named_ports=named_ports_from_json(value),
        )

    async def delete_ip(self, prefix: str, *, revision: int) -> int | None:
        """Deletes the entry of prefix if it is still at revision; the
        revision of the delete, or None when it changed."""
        key = keys.ip_key(prefix)
        result = await self.etcd.txn([mod_revision_is(key, revision)], [delete_op(key)])
        return result.revision if result.succeeded else None

    # --- FQDN cache ---

    async def put_fqdn(
        self, entries: Sequence[FqdnEntry], lease: NodeLease
    ) -> FqdnStored | LeaseLost:
        """Puts entries (all of lease's node) on its lease, if it is alive,
        in one transaction; its revision."""
        ops = [
            put_op(
                keys.fqdn_key(e.node, e.endpoint, e.name),
                keys.dumps(fqdn_entry_json(e)),
                lease.lease,
            )
            for e in entries
        ]
        result = await self.etcd.txn(_node_guard(lease), ops)
        return FqdnStored(result.revision) if result.succeeded else LeaseLost()

    async def delete_fqdn(self, entries: Sequence[FqdnEntry]) -> FqdnDeleted | FqdnMoved:
        """Deletes entries in one transaction if none changed since read
        (revision)."""
        where = [keys.fqdn_key(e.node, e.endpoint, e.name) for e in entries]
        result = await self.etcd.txn(
            [mod_revision_is(k, e.revision) for k, e in zip(where, entries, strict=True)],
            [delete_op(k) for k in where],
        )
        return FqdnDeleted(result.revision) if result.succeeded else FqdnMoved()

    # --- rules ---

    async def put_rules(self, rules: Sequence[Rule]) -> int:
        """All rules in one transaction; returns its revision."""
        result = await self.etcd.txn(
            [], [put_op(keys.rule_key(r.key), rule_to_json(r)) for r in rules]
        )
        return result.revision

    async def sync_rule(self, name: str, rule: Rule | None, *, revision: int) -> int | None:
        """Puts rule under name (deletes name when rule is None) in one
        transaction, if the key is still at revision (0: absent). The
        revision written, or None when the key had moved (another writer)."""
        value = rule_to_json(rule) if rule is not None else None
        return await self._sync_key(keys.rule_key(name), value, revision)

    async def sync_cidr_group(
        self, name: str, group: CIDRGroup | None, *, revision: int
    ) -> int | None:
        """sync_rule for a CIDR group."""
        value = cidr_group_to_json(group) if group is not None else None
        return await self._sync_key(keys.cidr_group_key(name), value, revision)

    async def _sync_key(self, key: str, value: bytes | None, revision: int) -> int | None:
        ops = [put_op(key, value)] if value is not None else [delete_op(key)]
        result = await self.etcd.txn([mod_revision_is(key, revision)], ops)
        return result.revision if result.succeeded else None

    async def delete_rule(self, name: str) -> tuple[bool, int]:
        return await self._delete_present(keys.rule_key(name))

    async def put_cidr_group(self, group: CIDRGroup) -> int:
        result = await self.etcd.txn(
            [], [put_op(keys.cidr_group_key(group.name), cidr_group_to_json(group))]
        )
        return result.revision

    async def delete_cidr_group(self, name: str) -> tuple[bool, int]:
        return await self._delete_present(keys.cidr_group_key(name))

    async def _delete_present(self, key: str) -> tuple[bool, int]:
        """(whether key was there and is now deleted, the revision)."""
        result = await self.etcd.txn([absent(key)], [], [delete_op(key)])
        return (not result.succeeded), result.revision


@dataclass(frozen=True)
class IdentityToDelete:
    """An identity the GC found unreferenced, with its keys' revisions then."""

    id: int
    labels: str
    id_revision: int
    labels_revision: int


# Identities per GC transaction: three compares each, within etcd's 128
# operations.
DELETES_PER_TXN = 32


def _delete_identity_ops(
    ident: int, labels: str, id_revision: int, labels_revision: int
) -> tuple[list[Any], list[Any]]:
    return (
        [
            prefix_absent(keys.ref_prefix(labels)),
            mod_revision_is(keys.id_key(ident), id_revision),
            mod_revision_is(keys.labels_key(labels), labels_revision),
        ],
        [delete_op(keys.id_key(ident)), delete_op(keys.labels_key(labels))],
    )
