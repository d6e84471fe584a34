"""Host policies (rules with a nodeSelector, as Cilium's): each node's host
is an endpoint of identity host (1) on its own node, with the labels
reserved:host and the node's labels (k8s: source) from the ipam node
registry. The policy of a node's host is the resolution of the host rules
whose nodeSelector selects those labels (resolve.Resolver.host_content);
WatchHostPolicy sends it whole, again whenever it changes.

Why a stream of its own and not WatchPolicy: the host policy depends on
the node's labels, which live in ipam's registry, outside the one key range
(and revision) the policy mirror follows and WatchPolicy resumes from; and
there is one small host policy per node, so each message carries all of it
and nothing needs resuming.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flagella.common.etcd import KeyValue
from flagella.policy.identities import IdentityInfo, Kind
from flagella.policy.labels import DEFAULT_SOURCE, SOURCE_RESERVED, Label, LabelError, label_set
from flagella.policy.resolve import PolicyContent

if TYPE_CHECKING:
    from flagella.policy.mirror import Mirror

log = logging.getLogger(__name__)

HOST_IDENTITY = 1
# The ipam service's node registry (read only: the policy service's etcd
# role grants it; flagella.common.etcdauth).
IPAM_NODES_PREFIX = "flagella/ipam/v1/nodes/"

Labels = tuple[tuple[str, str], ...]


def host_info(node_labels: Mapping[str, str]) -> IdentityInfo:
    """The host endpoint as selectors see it: reserved:host and the node's
    labels (keys without a source: k8s:, as selectors read them). A label
    that is not a valid label is left out (logged)."""
    labels = [Label.make(SOURCE_RESERVED, "host")]
    for key, value in node_labels.items():
        try:
            labels.append(Label.make(DEFAULT_SOURCE, key, value))
        except LabelError as exc:
            log.warning(
                "node label left out of host labels", extra={"label": key, "error": str(exc)}
            )
    return IdentityInfo.make(HOST_IDENTITY, label_set(labels), Kind.RESERVED)


class NodeLabelsCodec:
    """ipam's nodes/<name> -> the node's labels (only those are read)."""

    def key(self, key: str) -> str | None:
        return key[len(IPAM_NODES_PREFIX) :] if key.startswith(IPAM_NODES_PREFIX) else None

    def decode(self, key: str, kv: KeyValue) -> Labels | None:
        try:
            labels = json.loads(kv.value).get("labels") or {}
            return tuple(sorted((str(k), str(v)) for k, v in labels.items()))
        except (ValueError, AttributeError) as exc:
            log.warning("bad node entry", extra={"key": kv.key, "error": repr(exc)})
            return None


class NodeLabels:
    """The labels of every registered node (a Sink of the sync layer's
    EtcdSource); waiters learn of any change."""

    def __init__(self) -> None:
        self.labels: dict[str, Labels] = {}
        self.revision = 0
        self.live = False
        self._changed = asyncio.Event()
        self.initialized = asyncio.Event()

    def get(self, key: str) -> Labels | None:
        return self.labels.get(key)

    def replace(self, records: Iterable[tuple[str, Labels, int]], revision: int) -> None:
        self.labels = {k: r for k, r, _ in records}
        self._bump(revision)
        self.initialized.set()

    def commit(self, updates: Iterable[tuple[str, Labels | None, int]], revision: int) -> None:
        for key, record, _ in updates:
            if record is None:
                self.labels.pop(key, None)
            else:
                self.labels[key] = record
        self._bump(revision)

    def advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)

    def set_live(self, live: bool, reason: str = "") -> None:
        self.live = live

    def _bump(self, revision: int) -> None:
        self.revision = max(self.revision, revision)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """One node's host policy as sent: content None = no host rule selects
    the node (nothing enforced on its host)."""

    node: str
    revision: int
    content: PolicyContent | None
    node_labels: Labels = ()
    rules: tuple[str, ...] = field(default=())

    def same(self, other: HostPolicy | None) -> bool:
        return (
            other is not None
            and other.content == self.content
            and other.node_labels == self.node_labels
            and other.rules == self.rules
        )


def resolve_host(mirror: Mirror, nodes: NodeLabels, node: str) -> HostPolicy:
    state = mirror.state
    labels = nodes.get(node) or ()
    found = state.resolver.host_content(host_info(dict(labels)))
    if found is None:
        return HostPolicy(node, state.revision, None, labels)
    content, rules = found
    return HostPolicy(node, state.revision, content, labels, tuple(sorted(rules)))


async def watch_host_policy(
    mirror: Mirror, nodes: NodeLabels, node: str, *, heartbeat: float = 30.0
) -> AsyncIterator[HostPolicy]:
    """The node's host policy now, then again each time it changes (a rule,
    a peer identity, the node's labels), and every heartbeat seconds when
    nothing changed (a keepalive for the stream)."""
    await nodes.initialized.wait()
    sub = mirror.subscribe()
    try:
        last: HostPolicy | None = None
        while True:
            current = resolve_host(mirror, nodes, node)
            if not current.same(last):
                last = current
                yield current
            mirror_change = asyncio.ensure_future(sub.next(heartbeat))
            labels_change = asyncio.ensure_future(nodes.wait_changed())
            try:
                done, _ = await asyncio.wait(
                    (mirror_change, labels_change), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for fut in (mirror_change, labels_change):
                    if not fut.done():
                        fut.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await fut
            if mirror_change in done and mirror_change.result() is None:
                last = None  # idle for a heartbeat: send it again
    finally:
        sub.close()
