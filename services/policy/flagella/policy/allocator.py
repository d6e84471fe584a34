"""Identity allocation, release and lookup: a node's (or an owner's)
references on identities, creating an identity on first use."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from flagella.common.errors import NotFound, ResourceExhausted, Unavailable
from flagella.common.etcd import KeyValue
from flagella.policy import keys
from flagella.policy.identities import (
    MAX_GLOBAL,
    MIN_GLOBAL,
    RESERVED_NAMES,
    Kind,
    is_global,
    reserved_identity_of,
    reserved_labels,
)
from flagella.policy.labels import Label, LabelSet, format_labels, label_set
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.state import PolicyState
from flagella.policy.store import MAX_ATTEMPTS, PolicyStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IdentityView:
    id: int
    labels: LabelSet
    reserved: bool
    referenced_by: tuple[str, ...] = ()
    revision: int = 0


@dataclass(frozen=True, slots=True)
class Allocation:
    identity: IdentityView
    created: bool


def _first(ranges: list[list[KeyValue]], index: int) -> KeyValue | None:
    if index < len(ranges) and ranges[index]:
        return ranges[index][0]
    return None


class IdentityAllocator:
    """Identities: allocation (a node's or an owner's reference), release,
    and lookups of identities by id or labels."""

    def __init__(self, store: PolicyStore, mirror: Mirror, leases: NodeLeases) -> None:
        self.store = store
        self.mirror = mirror
        self.leases = leases
        self._inflight: set[int] = set()
        self._taken: set[int] = set()

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    def _view(self, ident: int, *, revision: int = 0) -> IdentityView | None:
        state = self.state
        info = state.info(ident)
        if info is None:
            return None
        rev = revision
        if not rev and info.kind is Kind.GLOBAL:
            gid = state.identities.get(ident)
            rev = gid.mod_revision if gid else 0
        return IdentityView(
            id=ident,
            labels=info.labels,
            reserved=info.kind is not Kind.GLOBAL,
            referenced_by=tuple(state.referenced_by(ident)),
            revision=rev,
        )

    def _candidate(self) -> int:
        """A free id to try: just above the highest one in use, a little
        randomized so that replicas (and calls in flight here) rarely pick
        the same; once the top of the range is reached, the lowest free."""
        state = self.state
        known = state.identities
        if len(self._taken) > 1024:
            self._taken = {i for i in self._taken if i not in known}

        def free(ident: int) -> bool:
            return ident not in known and ident not in self._inflight and ident not in self._taken

        base = max(state.max_global_id + 1, MIN_GLOBAL)
        window = 4 + 4 * len(self._inflight)
        for ident in range(base + random.randrange(window), MAX_GLOBAL + 1):
            if free(ident):
                return ident
        for ident in range(MIN_GLOBAL, MAX_GLOBAL + 1):
            if free(ident):
                return ident
        raise ResourceExhausted(
            f"all identities {MIN_GLOBAL}-{MAX_GLOBAL} are allocated", field="labels"
        )

    async def allocate_identity(self, labels: LabelSet, node: str, owner: str = "") -> Allocation:
        """Takes a reference of node on the identity of labels, creating the
        identity if needed. Never gives one label set two ids or one id two
        label sets: labels/<labels> and id/<id> are created together only if
        both are absent.

        With an owner, the reference is the owner's: if it already holds
        one on that identity and node, nothing is written and the answer's
        revision is the one that took it (idempotent). Without, the node's
        anonymous count goes up by one."""
        ls = labels
        label_string = format_labels(ls)
        reserved = reserved_identity_of(ls)
        self.leases.touch(node)
        # What we know: from the mirror first, then from failed transactions.
        known: tuple[int, int] | None = (
            (reserved, 0) if reserved is not None else self.state.labels_index.get(label_string)
        )
        ref: tuple[int, int, int] | None  # (mod_revision, refs, lease)
        if owner:
            held = self.state.owner_ref(label_string, node, owner)
            ref = (held.mod_revision, 1, held.lease) if held else None
        else:
            cached = self.state.refs.get((label_string, node))
            ref = (cached.mod_revision, cached.refs, cached.lease) if cached else None
        for _ in range(MAX_ATTEMPTS):
            # (an owner's repeat writes nothing: it needs no lease)
            needs_lease = known is None or ref is None or not owner
            lease = await self.leases.lease_for(node) if needs_lease else None
            if known is None:
                assert lease is not None
                ident = self._candidate()
                self._inflight.add(ident)
                try:
                    result = await self.store.create_identity(
                        ident, label_string, [str(lb) for lb in ls], lease, owner
                    )
                finally:
                    self._inflight.discard(ident)
                if result.succeeded:
                    self.leases.attached(lease)
                    log.info(
                        "identity created",
                        extra={"identity": ident, "labels": label_string, "node": node},
                    )
                    return await self._allocated(ident, ls, node, result.revision, created=True)
                labels_kv = _first(result.ranges, 0)
                id_kv = _first(result.ranges, 1)
                if labels_kv is not None:
                    known = (int(keys.loads(labels_kv.value)["id"]), labels_kv.mod_revision)
                    if owner:
                        ref = _owned_of(
                            await self.store.get_owned_reference(label_string, node, owner)
                        )
                    else:
                        ref = _ref_of(await self.store.get_reference(label_string, node))
                elif id_kv is not None:
                    self._taken.add(ident)
                else:
                    self.leases.lost(lease)
                continue
            ident, labels_revision = known
            if owner:
                result = await self.store.take_owned_reference(
                    label_string,
                    ident,
                    node,
                    owner,
                    held_revision=ref[0] if ref else 0,
                    guard=lease,
                    labels_revision=None if reserved is not None else labels_revision,
                )
                if result.succeeded and ref is not None:
                    # Already held: the revision that took it.
                    return await self._allocated(ident, ls, node, ref[0], created=False)
            else:
                refs = ref[1] if ref else 0
                result = await self.store.set_reference(
                    label_string,
                    ident,
                    node,
                    refs + 1,
                    guard=lease,
                    ref_revision=ref[0] if ref else 0,
                    lease=ref[2] if ref else 0,
                    labels_revision=None if reserved is not None else labels_revision,
                )
            if result.succeeded:
                if ref is None and lease is not None:
                    self.leases.attached(lease)
                return await self._allocated(ident, ls, node, result.revision, created=False)
            labels_kv = _first(result.ranges, 0)
            ref_kv = _first(result.ranges, 1)
            fresh_ref = _owned_of(ref_kv) if owner else _ref_of(ref_kv)
            if reserved is None:
                if labels_kv is None:
                    known = None  # garbage-collected meanwhile: create again
                    ref = fresh_ref
                    continue
                fresh_known = (int(keys.loads(labels_kv.value)["id"]), labels_kv.mod_revision)
                if fresh_known != known:
                    known, ref = fresh_known, fresh_ref
                    continue
            if fresh_ref != ref:
                ref = fresh_ref
                if owner and ref_kv is not None and int(keys.loads(ref_kv.value)["id"]) == ident:
                    # The owner holds it (read with the labels, in one
                    # transaction): the mirror had not seen it yet.
                    return await self._allocated(
                        ident, ls, node, ref_kv.mod_revision, created=False
                    )
                continue
            if lease is not None:
                self.leases.lost(lease)  # only the node's lease can have failed
        raise Unavailable("identity allocation kept conflicting; retry", field="labels")

    async def _allocated(
        self, ident: int, labels: LabelSet, node: str, revision: int, *, created: bool
    ) -> Allocation:
        """The answer of an allocation whose reference exists at revision,
        once this replica's mirror has seen it."""
        await self.mirror.wait_for(revision)
        view = self._view(ident, revision=revision) or IdentityView(
            ident, labels, not is_global(ident), (node,), revision
        )
        return Allocation(replace(view, revision=revision), created)

    async def release_identity(self, ident: int, node: str, owner: str = "") -> bool:
        """Drops one reference of node (owner's, or one of the anonymous
        count when owner is empty); True when it was the node's last, of
        any owner or none. Releasing what is not held is a no-op (False)."""
        label_string = self._label_string_of(ident)
        if label_string is None:
            kv = await self.store.get_identity(ident) if is_global(ident) else None
            if kv is None:
                return False
            label_string = format_labels(
                label_set(Label.parse(t) for t in keys.loads(kv.value)["labels"])
            )
        if owner:
            return await self._release_owned(ident, label_string, node, owner)
        cached = self.state.refs.get((label_string, node))
        ref = (cached.mod_revision, cached.refs, cached.lease) if cached else None
        if ref is None:
            ref = _ref_of(await self.store.get_reference(label_string, node))
        for _ in range(MAX_ATTEMPTS):
            if ref is None:
                return False
            refs = ref[1] - 1
            result = await self.store.set_reference(
                label_string,
                ident,
                node,
                refs,
                guard=None,
                ref_revision=ref[0],
                lease=ref[2],
                labels_revision=None,
            )
            if result.succeeded:
                await self.mirror.wait_for(result.revision)
                last = refs <= 0 and not _first(result.ranges, 0)
                if last:
                    log.info("identity released by node", extra={"identity": ident, "node": node})
                return last
            ref = _ref_of(_first(result.ranges, 1))
        raise Unavailable("identity release kept conflicting; retry", field="id")

    async def _release_owned(self, ident: int, label_string: str, node: str, owner: str) -> bool:
        held = self.state.owner_ref(label_string, node, owner)
        revision = held.mod_revision if held else 0
        if not revision:
            # Not in the mirror: it may be newer than what the mirror saw.
            kv = await self.store.get_owned_reference(label_string, node, owner)
            revision = kv.mod_revision if kv else 0
        own_key = keys.owner_key(label_string, node, owner)
        for _ in range(MAX_ATTEMPTS):
            if not revision:
                return False
            result = await self.store.drop_owned_reference(
                label_string, node, owner, revision=revision
            )
            if result.succeeded:
                await self.mirror.wait_for(result.revision)
                anonymous = _first(result.ranges, 0)
                others = [kv for kv in result.ranges[1] if kv.key != own_key]
                last = anonymous is None and not others
                if last:
                    log.info("identity released by node", extra={"identity": ident, "node": node})
                return last
            kv = _first(result.ranges, 0)
            revision = kv.mod_revision if kv else 0
        raise Unavailable("identity release kept conflicting; retry", field="id")

    def _label_string_of(self, ident: int) -> str | None:
        if ident in RESERVED_NAMES:
            return format_labels(reserved_labels(ident))
        gid = self.state.identities.get(ident)
        return gid.label_string if gid else None

    async def get_identity(self, ident: int) -> IdentityView:
        view = self._view(ident)
        if view is not None:
            return view
        if is_global(ident):
            kv = await self.store.get_identity(ident)
            if kv is not None:
                await self.mirror.wait_for(kv.mod_revision)
                view = self._view(ident)
                if view is not None:
                    return view
        raise NotFound(f"identity {ident} does not exist", field="id")

    async def lookup_identity(self, labels: LabelSet) -> IdentityView:
        """By labels, without allocating: from the mirror, or etcd when the
        mirror does not know them yet."""
        ident = self.state.identity_of_labels(labels)
        if ident is None:
            kv = await self.store.get_labels(format_labels(labels))
            if kv is not None:
                await self.mirror.wait_for(kv.mod_revision)
                ident = self.state.identity_of_labels(labels)
        view = self._view(ident) if ident is not None else None
        if view is None:
            raise NotFound(f"no identity has labels {format_labels(labels)}", field="labels")
        return view

    def list_identities(self, label_filter: Sequence[Label]) -> tuple[list[IdentityView], int]:
        state = self.state
        wanted = set(label_filter)
        out = []
        for ident in sorted(state.resolver.identities):
            info = state.resolver.identities[ident]
            if wanted and not wanted.issubset(info.labels):
                continue
            view = self._view(ident)
            if view is not None:
                out.append(view)
        return out, state.revision


def _ref_of(kv: KeyValue | None) -> tuple[int, int, int] | None:
    if kv is None:
        return None
    return kv.mod_revision, int(keys.loads(kv.value)["refs"]), kv.lease


def _owned_of(kv: KeyValue | None) -> tuple[int, int, int] | None:
    """An owner's reference as _ref_of gives a count: (mod_revision, 1, lease)."""
    if kv is None:
        return None
    return kv.mod_revision, 1, kv.lease
