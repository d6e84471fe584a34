"""Host policies (rules with a nodeSelector, as Cilium's): each node's host
is an endpoint of identity host (1) on its own node, with the labels
reserved:host and the node's labels (k8s: source), those of its
registration in the ipam node registry, which its datapath sends with
WatchHostPolicy. The policy of a node's host is the resolution of the host
rules whose nodeSelector selects those labels
(resolve.Resolver.host_content); WatchHostPolicy sends it whole, again
whenever it changes.

Why a stream of its own and not WatchPolicy: the host policy depends on
the node's labels, which are not in the key range (and revision) the policy
mirror follows and WatchPolicy resumes from; and there is one small host
policy per node, so each message carries all of it and nothing needs
resuming. Why the labels come with the request rather than from etcd: the
policy service's etcd user reads only the policy's keys (least privilege),
and the labels are the node's own claim in the registry either way (the
datapath registered them); a node misstating them could only weaken the
host firewall it enforces itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flagella.policy.identities import IdentityInfo, Kind
from flagella.policy.labels import DEFAULT_SOURCE, SOURCE_RESERVED, Label, label_set
from flagella.policy.resolve import PolicyContent

if TYPE_CHECKING:
    from flagella.policy.mirror import Mirror

log = logging.getLogger(__name__)

HOST_IDENTITY = 1

Labels = tuple[tuple[str, str], ...]


def host_info(node_labels: Mapping[str, str]) -> IdentityInfo:
    """The host endpoint as selectors see it: reserved:host and the node's
    labels (keys without a source: k8s:, as selectors read them). Raises
    LabelError on a label that is not one (the servicer checks first)."""
    labels = [Label.make(SOURCE_RESERVED, "host")]
    labels += [Label.make(DEFAULT_SOURCE, key, value) for key, value in node_labels.items()]
    return IdentityInfo.make(HOST_IDENTITY, label_set(labels), Kind.RESERVED)


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


class HostPolicies:
    """The host policies of the nodes' label sets, each resolved once per
    change of the host rules or of what they select (Mirror.host_epoch),
    however many nodes share the labels; and the streams of them, woken
    only by such a change (Mirror.subscribe_host)."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self._epoch = -1
        self._resolved: dict[Labels, tuple[int, PolicyContent | None, tuple[str, ...]]] = {}

    def resolve(self, node: str, labels: Labels) -> HostPolicy:
        mirror = self.mirror
        if mirror.host_epoch != self._epoch:
            self._epoch = mirror.host_epoch
            self._resolved.clear()
        hit = self._resolved.get(labels)
        if hit is None:
            state = mirror.state
            found = state.resolver.host_content(host_info(dict(labels)))
            if found is None:
                hit = (state.revision, None, ())
            else:
                hit = (state.revision, found[0], tuple(sorted(found[1])))
            self._resolved[labels] = hit
        revision, content, rules = hit
        return HostPolicy(node, revision, content, labels, rules)

    async def watch(
        self, node: str, labels: Labels, *, heartbeat: float = 30.0
    ) -> AsyncIterator[HostPolicy]:
        """The host policy of the node with these labels now, then again
        each time it changes (a rule, a peer identity), and every heartbeat
        seconds when nothing changed (a keepalive for the stream)."""
        sub = self.mirror.subscribe_host()
        try:
            last: HostPolicy | None = None
            while True:
                current = self.resolve(node, labels)
                if not current.same(last):
                    last = current
                    yield current
                if await sub.next(heartbeat) is None:
                    last = None  # idle for a heartbeat: send it again
        finally:
            sub.close()
