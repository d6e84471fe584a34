"""What this node's BGP speaker should be, from the peering policies and
the services (pure logic: no I/O).

A node applies every peering policy whose node selector selects it, in
name order, merged into one speaker (one gobgpd): the first virtual router
applied gives the speaker's ASN and router id, the others' neighbours get
their own local ASN (GoBGP's per-neighbour local-as). What cannot be merged
is reported and skipped, the rest applied: a virtual router whose ASN an
earlier one took, one whose router id differs from the speaker's, a
neighbour an earlier virtual router has already.

Each neighbour is sent the prefixes of its virtual router of its own
address family (IPv4 prefixes to IPv4 neighbours, IPv6 ones to IPv6
neighbours): the node's pod CIDRs (exportPodCIDR) and the external
addresses (LoadBalancer ingress, external IPs) of the services the virtual
router's serviceSelector selects, from nodes that may serve them: with
externalTrafficPolicy Cluster every node, with Local only a node with an
active backend of its own.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flagella.api.lb.v1 import lb_pb2

# The labels a service selector matches besides the service's own, as
# Cilium's (and LB-IPAM's pool selectors).
NAMESPACE_LABEL = "io.kubernetes.service.namespace"
NAME_LABEL = "io.kubernetes.service.name"


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Selector:
    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Kubernetes label selector semantics (empty: everything; an
        unknown operator matches nothing)."""
        for key, value in self.match_labels:
            if labels.get(key) != value:
                return False
        for r in self.match_expressions:
            present = r.key in labels
            if r.operator == "In":
                ok = present and labels[r.key] in r.values
            elif r.operator == "NotIn":
                ok = not present or labels[r.key] not in r.values
            elif r.operator == "Exists":
                ok = present
            elif r.operator == "DoesNotExist":
                ok = not present
            else:
                ok = False
            if not ok:
                return False
        return True


@dataclass(frozen=True, slots=True)
class Neighbor:
    peer_address: str
    peer_asn: int
    peer_port: int
    hold_time: int
    keep_alive: int
    connect_retry: int
    ebgp_multihop_ttl: int
    password: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class VirtualRouter:
    local_asn: int
    export_pod_cidr: bool
    service_selector: Selector | None  # None: no service
    neighbors: tuple[Neighbor, ...]
    router_id: str = ""


@dataclass(frozen=True, slots=True)
class PeeringPolicy:
    name: str
    node_selector: Selector | None  # None: every node
    virtual_routers: tuple[VirtualRouter, ...]


@dataclass(frozen=True, slots=True)
class AdvertisedService:
    """What the speaker needs of one lb service."""

    name: str  # namespace/name[:port]
    namespace: str
    labels: tuple[tuple[str, str], ...]
    # LoadBalancer ingress addresses and external IPs.
    addresses: tuple[str, ...]
    local_traffic: bool  # externalTrafficPolicy Local
    # Nodes with an active backend.
    backend_nodes: frozenset[str]

    def selector_labels(self) -> dict[str, str]:
        base = self.name.partition("/")[2].partition(":")[0] or self.name
        return {**dict(self.labels), NAMESPACE_LABEL: self.namespace, NAME_LABEL: base}

    def served_by(self, node: str) -> bool:
        return not self.local_traffic or node in self.backend_nodes


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    labels: tuple[tuple[str, str], ...]
    ipv4: str
    ipv6: str
    pod_cidrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One neighbour as gobgpd is to have it."""

    address: str
    port: int
    asn: int
    local_asn: int
    hold_time: int
    keep_alive: int
    connect_retry: int
    ebgp_multihop_ttl: int
    policy: str
    password: str = field(default="", repr=False)

    @property
    def family(self) -> int:
        return ipaddress.ip_address(self.address).version

    def fingerprint(self) -> str:
        """What gobgpd's copy is compared by (kept in its description: its
        password is never read back)."""
        text = "|".join(
            str(v)
            for v in (
                self.address,
                self.port,
                self.asn,
                self.local_asn,
                self.hold_time,
                self.keep_alive,
                self.connect_retry,
                self.ebgp_multihop_ttl,
                self.password,
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Desired:
    """The speaker: gobgpd's global settings, its neighbours, its own paths
    (prefix -> next hop) and what each neighbour is sent."""

    asn: int
    router_id: str
    listen_addresses: tuple[str, ...]
    peers: Mapping[str, PeerSpec]
    paths: Mapping[str, str]
    exports: Mapping[str, frozenset[str]]
    policies: tuple[str, ...]
    not_applied: tuple[str, ...] = ()


def _family(prefix: str) -> int:
    return ipaddress.ip_network(prefix, strict=False).version


def host_prefix(address: str) -> str:
    ip = ipaddress.ip_address(address)
    return f"{ip}/{ip.max_prefixlen}"


def selected(node: NodeInfo, policies: Iterable[PeeringPolicy]) -> list[PeeringPolicy]:
    labels = dict(node.labels)
    return sorted(
        (p for p in policies if p.node_selector is None or p.node_selector.matches(labels)),
        key=lambda p: p.name,
    )


def router_prefixes(
    node: NodeInfo, vr: VirtualRouter, services: Iterable[AdvertisedService]
) -> set[str]:
    """The prefixes a virtual router advertises from this node."""
    out: set[str] = set()
    if vr.export_pod_cidr:
        out |= {str(ipaddress.ip_network(c, strict=False)) for c in node.pod_cidrs}
    if vr.service_selector is not None:
        for svc in services:
            if svc.served_by(node.name) and vr.service_selector.matches(svc.selector_labels()):
                out |= {host_prefix(a) for a in svc.addresses}
    return out


def desired(
    node: NodeInfo,
    policies: Iterable[PeeringPolicy],
    services: Iterable[AdvertisedService],
    listen_port: int,
) -> Desired | None:
    """The speaker this node should run, or None: no policy selects it."""
    chosen = selected(node, policies)
    if not chosen:
        return None
    services = list(services)
    skipped: list[str] = []
    asn = 0
    router_id = ""
    used_asns: dict[int, str] = {}
    peers: dict[str, PeerSpec] = {}
    exports: dict[str, frozenset[str]] = {}
    applied: list[str] = []
    for policy in chosen:
        took = False
        for i, vr in enumerate(policy.virtual_routers):
            where = f"policy {policy.name} virtual router {i} (ASN {vr.local_asn})"
            if vr.local_asn in used_asns:
                skipped.append(f"{where}: ASN already used by {used_asns[vr.local_asn]}")
                continue
            rid = vr.router_id or node.ipv4
            if not rid:
                skipped.append(f"{where}: no router id (the node has no IPv4 address)")
                continue
            if router_id and rid != router_id:
                skipped.append(f"{where}: router id {rid} differs from the speaker's {router_id}")
                continue
            if not asn:
                asn, router_id = vr.local_asn, rid
            used_asns[vr.local_asn] = f"policy {policy.name}"
            took = True
            prefixes = router_prefixes(node, vr, services)
            for n in vr.neighbors:
                if n.peer_address in peers:
                    skipped.append(
                        f"{where}: neighbor {n.peer_address} is already a neighbor of "
                        f"policy {peers[n.peer_address].policy}"
                    )
                    continue
                family = ipaddress.ip_address(n.peer_address).version
                if (family == 4 and not node.ipv4) or (family == 6 and not node.ipv6):
                    skipped.append(
                        f"{where}: neighbor {n.peer_address}: the node has no IPv{family} address"
                    )
                    continue
                peers[n.peer_address] = PeerSpec(
                    address=n.peer_address,
                    port=n.peer_port,
                    asn=n.peer_asn,
                    local_asn=vr.local_asn,
                    hold_time=n.hold_time,
                    keep_alive=n.keep_alive,
                    connect_retry=n.connect_retry,
                    ebgp_multihop_ttl=n.ebgp_multihop_ttl,
                    policy=policy.name,
                    password=n.password,
                )
                exports[n.peer_address] = frozenset(p for p in prefixes if _family(p) == family)
        if took:
            applied.append(policy.name)
    if not asn:
        # Selected, but nothing in it applies: no speaker, and say why.
        return Desired(0, "", (), {}, {}, {}, (), tuple(skipped))
    paths: dict[str, str] = {}
    for allowed in exports.values():
        for p in allowed:
            paths[p] = node.ipv4 if _family(p) == 4 else node.ipv6
    listen = tuple(a for a in (node.ipv4, node.ipv6) if a)
    return Desired(
        asn=asn,
        router_id=router_id,
        listen_addresses=listen,
        peers=peers,
        paths=paths,
        exports=exports,
        policies=tuple(applied),
        not_applied=tuple(skipped),
    )


# --- the streams' records ---


def _selector(msg: lb_pb2.LabelSelector) -> Selector:
    return Selector(
        tuple(sorted(msg.match_labels.items())),
        tuple(Requirement(r.key, r.operator, tuple(r.values)) for r in msg.match_expressions),
    )


def policy_from_proto(msg: lb_pb2.BgpPeeringPolicy) -> PeeringPolicy:
    return PeeringPolicy(
        name=msg.name,
        node_selector=_selector(msg.node_selector) if msg.HasField("node_selector") else None,
        virtual_routers=tuple(
            VirtualRouter(
                local_asn=vr.local_asn,
                export_pod_cidr=vr.export_pod_cidr,
                service_selector=(
                    _selector(vr.service_selector) if vr.HasField("service_selector") else None
                ),
                router_id=vr.router_id,
                neighbors=tuple(
                    Neighbor(
                        peer_address=n.peer_address,
                        peer_asn=n.peer_asn,
                        peer_port=n.peer_port or 179,
                        hold_time=n.hold_time_seconds or 90,
                        keep_alive=n.keep_alive_time_seconds or 30,
                        connect_retry=n.connect_retry_time_seconds or 120,
                        ebgp_multihop_ttl=n.ebgp_multihop_ttl or 1,
                        password=n.password,
                    )
                    for n in vr.neighbors
                ),
            )
            for vr in msg.virtual_routers
        ),
    )


class PolicyCodec:
    """WatchBgpPeeringPolicies events -> policy name: the policy."""

    def key(self, event: lb_pb2.BgpPeeringPolicyEvent) -> str:
        return event.policy.name

    def decode(self, event: lb_pb2.BgpPeeringPolicyEvent) -> PeeringPolicy:
        return policy_from_proto(event.policy)


_ACTIVE = (lb_pb2.BACKEND_STATE_UNSPECIFIED, lb_pb2.BACKEND_STATE_ACTIVE)


def service_from_proto(msg: lb_pb2.Service) -> AdvertisedService | None:
    """The service's external addresses and who may serve them; None: it
    has none (only those matter to BGP)."""
    addresses = (*msg.load_balancer.ingress, *msg.external_ips)
    if not addresses:
        return None
    namespace = msg.namespace or (msg.name.partition("/")[0] if "/" in msg.name else "")
    return AdvertisedService(
        name=msg.name,
        namespace=namespace,
        labels=tuple(sorted(msg.labels.items())),
        addresses=tuple(sorted(set(addresses))),
        local_traffic=msg.external_traffic_policy == lb_pb2.TRAFFIC_POLICY_LOCAL,
        backend_nodes=frozenset(b.node for b in msg.backends if b.node and b.state in _ACTIVE),
    )


class ServiceCodec:
    """WatchServices events -> service id: what BGP needs of it (None for a
    service without external addresses: not kept)."""

    def key(self, event: lb_pb2.ServiceEvent) -> int:
        return event.service.id

    def decode(self, event: lb_pb2.ServiceEvent) -> AdvertisedService | None:
        return service_from_proto(event.service)
