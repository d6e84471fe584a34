"""What the policy store (flagella.policy.store) answers: records read from
etcd and the outcomes of its transactions, so that no caller reads keys,
etcd values or transaction results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from flagella.policy.labels import LabelSet

# --- records ---


@dataclass(frozen=True, slots=True)
class NodeLease:
    """A lease of a node, alive while its record nodes/<node>/<lease> is:
    every write that attaches a key to it checks the record."""

    node: str
    lease: int
    record_key: str
    record_revision: int


@dataclass(frozen=True, slots=True)
class LabelsEntry:
    """labels/<labels>: the identity a label set maps to."""

    id: int
    revision: int


@dataclass(frozen=True, slots=True)
class Reference:
    """A node's reference on an identity: its anonymous count (refs), or
    one owner's (refs 1). lease is the one it is bound to: a count keeps
    it when it changes."""

    id: int
    refs: int
    revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class StoredIdentity:
    """id/<id>: a global identity's labels."""

    id: int
    labels: LabelSet
    revision: int


# --- outcomes of transactions ---


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """The node's lease is gone (expired or revoked): nothing was written."""


@dataclass(frozen=True, slots=True)
class IdentityCreated:
    revision: int


@dataclass(frozen=True, slots=True)
class LabelsTaken:
    """The label set has an identity already; ref is the node's reference
    on it (the owner's, for an owner) as it was then."""

    labels: LabelsEntry
    ref: Reference | None


@dataclass(frozen=True, slots=True)
class IdTaken:
    """Another label set has the id."""


CreateOutcome: TypeAlias = IdentityCreated | LabelsTaken | IdTaken | LeaseLost


@dataclass(frozen=True, slots=True)
class ReferenceTaken:
    revision: int


@dataclass(frozen=True, slots=True)
class LabelsMoved:
    """The label set no longer maps to the identity at the revision given:
    labels is what it maps to now (None: no identity), ref the node's
    reference as it is now."""

    labels: LabelsEntry | None
    ref: Reference | None


@dataclass(frozen=True, slots=True)
class ReferenceMoved:
    """The reference is not the one given (ref: as it is now, or None)."""

    ref: Reference | None


TakeOutcome: TypeAlias = ReferenceTaken | LabelsMoved | ReferenceMoved | LeaseLost


@dataclass(frozen=True, slots=True)
class ReferenceDropped:
    """last: the node holds no other reference on the identity (no
    anonymous count, no owner's)."""

    revision: int
    last: bool


DropOutcome: TypeAlias = ReferenceDropped | ReferenceMoved


@dataclass(frozen=True, slots=True)
class IPEntryStored:
    revision: int


@dataclass(frozen=True, slots=True)
class FqdnStored:
    revision: int


@dataclass(frozen=True, slots=True)
class FqdnDeleted:
    revision: int


@dataclass(frozen=True, slots=True)
class FqdnMoved:
    """An entry to delete changed since it was read (the node wrote it again)."""
