"""The BPF ipcache of this node: what the policy service's ipcache says
(pods, CIDRs: prefix -> identity) merged with what the node registry says
(as Cilium's node discovery does):

- this node's IPs are `host`, every other node's IPs `remote-node`;
- every other node's pod CIDRs are in the map (identity world unless the
  policy's ipcache says more), and every prefix inside a node's pod CIDR
  carries that node as its tunnel endpoint (tunnel mode) and the cluster
  flag (never masqueraded), so a pod of another node is reached through the
  tunnel even before its own entry arrives.

Two typed tables feed it (the policy's ipcache stream and ipam's node
stream), each through its own Target; the map is pruned only once both had
their snapshot, so a restarted datapath never removes entries the other
stream has not confirmed yet.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from flagella.common.reconcile import Reconciler
from flagella.datapath.bpf.layout import Identity
from flagella.datapath.routes import NodeRecord

if TYPE_CHECKING:
    from flagella.datapath.service import DatapathService

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
V = TypeVar("V")


@dataclass(frozen=True)
class IPCacheInfo:
    """One BPF ipcache entry."""

    identity: int
    tunnel_ip: str = ""  # the node hosting the prefix (tunnel mode, IPv4)
    cluster: bool = False  # a node or inside a node's pod CIDR


class IPCacheOps:
    def __init__(self, svc: DatapathService) -> None:
        self.svc = svc

    async def update(self, key: str, value: IPCacheInfo) -> None:
        await self.svc.writer.run(
            self.svc.bpf.ipcache.upsert,
            key,
            value.identity,
            tunnel_ip=value.tunnel_ip,
            cluster=value.cluster,
        )

    async def delete(self, key: str) -> None:
        await self.svc.writer.run(self.svc.bpf.ipcache.remove, key)

    async def list_actual(self) -> Iterable[str]:
        entries = await self.svc.writer.run(self.svc.bpf.ipcache.entries)
        return list(entries)


@dataclass(frozen=True)
class _Owner:
    """The node a pod CIDR belongs to."""

    node: str
    tunnel_ip: str  # "" for this node


class IPCacheView:
    """Policy ipcache entries and node registry entries into one reconciler
    (see the module's docstring); policy_entries and node_entries are the
    Targets of the two tables."""

    def __init__(
        self, target: Reconciler[str, IPCacheInfo], local_node: str, *, tunnel: bool
    ) -> None:
        self.target = target
        self.local_node = local_node
        self.tunnel = tunnel
        self.identities: dict[str, int] = {}  # from the policy's ipcache
        self.nodes: dict[str, NodeRecord] = {}
        # pod CIDRs by (version, prefix length) -> network -> owner
        self._cidrs: dict[tuple[int, int], dict[Network, _Owner]] = {}
        self._node_prefixes: dict[str, IPCacheInfo] = {}
        # The tables feeding it (each Target adds its own), and those whose
        # snapshot arrived: the map is pruned once all have.
        self.sources: set[str] = set()
        self._synced: set[str] = set()

    @property
    def revision(self) -> int:
        return self.target.revision

    # --- the merge ---

    def _owner(self, prefix: str) -> _Owner | None:
        net = ipaddress.ip_network(prefix, strict=False)
        for (version, plen), cidrs in self._cidrs.items():
            if version == net.version and plen <= net.prefixlen:
                owner = cidrs.get(net.supernet(new_prefix=plen))
                if owner is not None:
                    return owner
        return None

    def _info(self, prefix: str) -> IPCacheInfo | None:
        node_entry = self._node_prefixes.get(prefix)
        identity = self.identities.get(prefix)
        if node_entry is not None and (identity is None or node_entry.identity != Identity.WORLD):
            return node_entry  # node IPs are the node registry's to name
        if identity is None:
            return None
        owner = self._owner(prefix)
        if owner is None:
            return IPCacheInfo(identity)
        return IPCacheInfo(identity, owner.tunnel_ip if self.tunnel else "", cluster=True)

    def _refresh(self, prefixes: Iterable[str]) -> None:
        if not self._synced >= self.sources:
            # Half the picture (a restart: the policy's entries but not yet
            # the nodes'): the map keeps what it holds until both are in.
            return
        for prefix in prefixes:
            info = self._info(prefix)
            if info is None:
                self.target.delete(prefix)
            else:
                self.target.upsert(prefix, info)

    def _rebuild_nodes(self) -> set[str]:
        """Node-derived entries and the CIDR index from self.nodes; returns
        every prefix whose entry may have changed."""
        before = set(self._node_prefixes)
        self._cidrs = {}
        entries: dict[str, IPCacheInfo] = {}
        for name, node in self.nodes.items():
            local = name == self.local_node
            tunnel_ip = "" if local else (node.ip_of(4) or "")
            for ip in node.ips:
                identity = Identity.HOST if local else Identity.REMOTE_NODE
                prefix = str(ipaddress.ip_network(ip))
                entries[prefix] = IPCacheInfo(int(identity), cluster=True)
            for cidr in node.pod_cidrs:
                net = ipaddress.ip_network(cidr, strict=False)
                owner = _Owner(name, tunnel_ip)
                self._cidrs.setdefault((net.version, net.prefixlen), {})[net] = owner
                if not local:
                    entries[str(net)] = IPCacheInfo(
                        int(Identity.WORLD), tunnel_ip if self.tunnel else "", cluster=True
                    )
        self._node_prefixes = entries
        return before | set(entries) | set(self.identities)

    def _snapshot(self, source: str) -> None:
        """A full sync of one source: once every source had one, the whole
        picture goes to the map, which is pruned (and again after any later
        full sync)."""
        first = not self._synced >= self.sources
        self._synced.add(source)
        if self._synced >= self.sources:
            if first:
                self._refresh(set(self.identities) | set(self._node_prefixes))
            self.target.request_prune()

    # --- called by the two tables' targets ---

    def replace_identities(self, items: dict[str, int]) -> int:
        changed = set(self.identities) | set(items)
        self.identities = dict(items)
        self._refresh(changed)
        self._snapshot("policy")
        return self.revision

    def set_identity(self, prefix: str, identity: int | None) -> int:
        if identity is None:
            self.identities.pop(prefix, None)
        else:
            self.identities[prefix] = identity
        self._refresh([prefix])
        return self.revision

    def replace_nodes(self, items: dict[str, NodeRecord]) -> int:
        self.nodes = dict(items)
        self._refresh(self._rebuild_nodes())
        self._snapshot("nodes")
        return self.revision

    def set_node(self, name: str, node: NodeRecord | None) -> int:
        if node is None:
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = node
        self._refresh(self._rebuild_nodes())
        return self.revision


class SourceTarget(Generic[V]):
    """The Target one table of the view writes through: its snapshot and
    its changes, keyed as that table is."""

    def __init__(
        self,
        view: IPCacheView,
        source: str,
        replace: Callable[[dict[str, V]], int],
        set_one: Callable[[str, V | None], int],
    ) -> None:
        self.view = view
        self._replace = replace
        self._set = set_one
        view.sources.add(source)

    @property
    def revision(self) -> int:
        return self.view.revision

    def replace_all(self, items: dict[str, V]) -> int:
        return self._replace(items)

    def upsert(self, key: str, value: V) -> int:
        return self._set(key, value)

    def delete(self, key: str) -> int:
        return self._set(key, None)


def policy_entries(view: IPCacheView) -> SourceTarget[int]:
    """Target of the policy's ipcache table (prefix -> identity)."""
    return SourceTarget(view, "policy", view.replace_identities, view.set_identity)


def node_entries(view: IPCacheView) -> SourceTarget[NodeRecord]:
    """Target of the node registry's table (name -> node)."""
    return SourceTarget(view, "nodes", view.replace_nodes, view.set_node)
