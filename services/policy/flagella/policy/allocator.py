"""Identity allocation, release and lookup: a node's (or an owner's)
references on identities, creating an identity on first use."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from flagella.common.errors import NotFound, ResourceExhausted, Unavailable
from flagella.policy.identities import (
    MAX_GLOBAL,
    MIN_GLOBAL,
    RESERVED_NAMES,
    Kind,
    is_global,
    reserved_identity_of,
    reserved_labels,
)
from flagella.policy.labels import Label, LabelSet, format_labels
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.outcomes import (
    DropOutcome,
    IdentityCreated,
    IdTaken,
    LabelsEntry,
    LabelsMoved,
    LabelsTaken,
    LeaseLost,
    Reference,
    ReferenceMoved,
    ReferenceTaken,
)
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


class IdentityAllocator:
    """Identities: allocation (a node's or an owner's reference), release,
    and lookups of identities by id or labels."""

    def __init__(self, store: PolicyStore, mirror: Mirror, leases: NodeLeases) -> None:
        self.store = store
        self.mirror = mirror
        self.leases = leases
        self._inflight: set[int] = set()
        self._taken: set[int] = set()
        # Where the search for a free id below the top resumes.
        self._wrapped = MIN_GLOBAL

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
        # The top was reached: the next free id after the last one picked
        # here, wrapping around (not the lowest free: with 50,000 ids held
        # below it that is a walk over all of them for every allocation).
        start = self._wrapped
        for ident in itertools.chain(range(start, MAX_GLOBAL + 1), range(MIN_GLOBAL, start)):
            if free(ident):
                self._wrapped = ident + 1 if ident < MAX_GLOBAL else MIN_GLOBAL
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
        anonymous count goes up by one. (labels, node and owner were
        validated by the servicer: flagella.policy.validation.)"""
        ls = labels
        label_string = format_labels(ls)
        reserved = reserved_identity_of(ls)
        self.leases.touch(node)
        # What we know: from the mirror first, then from failed transactions.
        known: LabelsEntry | None = (
            LabelsEntry(reserved, 0) if reserved is not None else self._labels_entry(label_string)
        )
        ref = self._cached_reference(label_string, node, owner)
        for _ in range(MAX_ATTEMPTS):
            # (an owner's repeat writes nothing: it needs no lease)
            needs_lease = known is None or ref is None or not owner
            lease = await self.leases.lease_for(node) if needs_lease else None
            if known is None:
                assert lease is not None
                ident = self._candidate()
                self._inflight.add(ident)
                try:
                    created = await self.store.create_identity(
                        ident, label_string, [str(lb) for lb in ls], lease, owner
                    )
                finally:
                    self._inflight.discard(ident)
                match created:
                    case IdentityCreated(revision):
                        self.leases.attached(lease)
                        log.info(
                            "identity created",
                            extra={"identity": ident, "labels": label_string, "node": node},
                        )
                        return await self._allocated(ident, ls, node, revision, created=True)
                    case LabelsTaken(taken_labels, taken_ref):
                        known, ref = taken_labels, taken_ref
                    case IdTaken():
                        self._taken.add(ident)
                    case LeaseLost():
                        self.leases.lost(lease)
                continue
            ident = known.id
            labels_revision = None if reserved is not None else known.revision
            if owner:
                taken = await self.store.take_owned_reference(
                    label_string,
                    ident,
                    node,
                    owner,
                    held=ref,
                    lease=lease,
                    labels_revision=labels_revision,
                )
                if isinstance(taken, ReferenceTaken) and ref is not None:
                    # Already held: the revision that took it.
                    return await self._allocated(ident, ls, node, ref.revision, created=False)
            else:
                assert lease is not None
                taken = await self.store.add_reference(
                    label_string, ident, lease, held=ref, labels_revision=labels_revision
                )
            match taken:
                case ReferenceTaken(revision):
                    if ref is None and lease is not None:
                        self.leases.attached(lease)
                    return await self._allocated(ident, ls, node, revision, created=False)
                case LabelsMoved(moved_labels, moved_ref):
                    # (labels None: garbage-collected meanwhile, create again)
                    known, ref = moved_labels, moved_ref
                case ReferenceMoved(moved_ref):
                    ref = moved_ref
                    if owner and ref is not None and ref.id == ident:
                        # The owner holds it (read with the labels, in one
                        # transaction): the mirror had not seen it yet.
                        return await self._allocated(ident, ls, node, ref.revision, created=False)
                case LeaseLost():
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
            stored = await self.store.get_identity(ident) if is_global(ident) else None
            if stored is None:
                return False
            label_string = format_labels(stored.labels)
        if owner:
            return await self._release_owned(ident, label_string, node, owner)
        return await self._drop(
            ident,
            node,
            label_string,
            "",
            lambda held: self.store.drop_reference(label_string, ident, node, held=held),
        )

    async def _release_owned(self, ident: int, label_string: str, node: str, owner: str) -> bool:
        return await self._drop(
            ident,
            node,
            label_string,
            owner,
            lambda held: self.store.drop_owned_reference(label_string, node, owner, held=held),
        )

    async def _drop(
        self,
        ident: int,
        node: str,
        label_string: str,
        owner: str,
        drop: Callable[[Reference], Awaitable[DropOutcome]],
    ) -> bool:
        """Drop the reference (the node's count, or an owner's) as held,
        again as it moved if another writer changed it meanwhile."""
        held = self._cached_reference(label_string, node, owner)
        if held is None:
            # Not in the mirror: it may be newer than what the mirror saw.
            held = await self.store.get_reference(label_string, node, owner)
        for _ in range(MAX_ATTEMPTS):
            if held is None:
                return False
            dropped = await drop(held)
            if isinstance(dropped, ReferenceMoved):
                held = dropped.ref
                continue
            await self.mirror.wait_for(dropped.revision)
            if dropped.last:
                log.info("identity released by node", extra={"identity": ident, "node": node})
            return dropped.last
        raise Unavailable("identity release kept conflicting; retry", field="id")

    def _labels_entry(self, label_string: str) -> LabelsEntry | None:
        """The identity the mirror has the labels map to."""
        found = self.state.labels_index.get(label_string)
        return LabelsEntry(*found) if found is not None else None

    def _cached_reference(self, label_string: str, node: str, owner: str) -> Reference | None:
        """The node's anonymous count (owner's reference, for an owner) as
        the mirror has it."""
        if owner:
            held = self.state.owner_ref(label_string, node, owner)
            return Reference(held.id, 1, held.mod_revision, held.lease) if held else None
        cached = self.state.refs.get((label_string, node))
        return (
            Reference(cached.id, cached.refs, cached.mod_revision, cached.lease) if cached else None
        )

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
            stored = await self.store.get_identity(ident)
            if stored is not None:
                await self.mirror.wait_for(stored.revision)
                view = self._view(ident)
                if view is not None:
                    return view
        raise NotFound(f"identity {ident} does not exist", field="id")

    async def lookup_identity(self, labels: LabelSet) -> IdentityView:
        """By labels, without allocating: from the mirror, or etcd when the
        mirror does not know them yet."""
        ident = self.state.identity_of_labels(labels)
        if ident is None:
            entry = await self.store.get_labels(format_labels(labels))
            if entry is not None:
                await self.mirror.wait_for(entry.revision)
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
