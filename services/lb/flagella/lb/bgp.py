"""BGP peering policies (Cilium's CiliumBGPPeeringPolicy, cilium.io/v2alpha1):
the domain model, its JSON form in etcd, its validation (every error names
the field by its path in the request, under `policy.`) and Cilium's
document read into it.

A policy selects nodes by their labels; each selected node's datapath runs
a BGP speaker with the policy's virtual routers (a local ASN, neighbours,
what to advertise). The lb service stores and streams the policies; each
datapath decides what applies to it (flagella.datapath.bgp).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flagella.common.errors import InvalidArgument
from flagella.lb import selector as sel
from flagella.lb.ciliumdoc import cilium_object, doc_list, doc_object
from flagella.lb.selector import Requirement
from flagella.lb.validation import SHORT_NAME_RE

MAX_ASN = 4294967295
MAX_VIRTUAL_ROUTERS = 16
MAX_NEIGHBORS = 64
# TCP MD5 signatures take keys of at most 80 bytes (TCP_MD5SIG_MAXKEYLEN).
MAX_PASSWORD = 80
# Defaults as Cilium's (and RFC 4271's suggestions).
DEFAULT_PORT = 179
DEFAULT_HOLD_TIME = 90
DEFAULT_KEEP_ALIVE = 30
DEFAULT_CONNECT_RETRY = 120


@dataclass(frozen=True, slots=True)
class Selector:
    """A Kubernetes label selector (empty: everything)."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def to_doc(self) -> dict[str, Any]:
        return {
            "match_labels": dict(self.match_labels),
            "match_expressions": sel.requirements_to_doc(self.match_expressions),
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Selector:
        return cls(
            tuple(sorted(doc.get("match_labels", {}).items())),
            sel.requirements_from_doc(doc.get("match_expressions", ())),
        )


@dataclass(frozen=True, slots=True)
class Neighbor:
    peer_address: str  # a bare IP
    peer_asn: int
    peer_port: int = DEFAULT_PORT
    hold_time: int = DEFAULT_HOLD_TIME
    keep_alive: int = DEFAULT_KEEP_ALIVE
    connect_retry: int = DEFAULT_CONNECT_RETRY
    ebgp_multihop_ttl: int = 1
    password: str = ""
    # Kubernetes: the Secret the password was read from.
    auth_secret_ref: str = ""


@dataclass(frozen=True, slots=True)
class VirtualRouter:
    local_asn: int
    export_pod_cidr: bool = False
    # None: no service is advertised; an empty Selector: every one.
    service_selector: Selector | None = None
    neighbors: tuple[Neighbor, ...] = ()
    router_id: str = ""


@dataclass(frozen=True)
class PeeringPolicy:
    name: str
    # None: every node.
    node_selector: Selector | None = None
    virtual_routers: tuple[VirtualRouter, ...] = ()
    # "api", or "kubernetes" (a CiliumBGPPeeringPolicy: flagella.lb.bgpk8s).
    source: str = "api"
    revision: int = field(default=0, compare=False)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "name": self.name,
            "node_selector": None if self.node_selector is None else self.node_selector.to_doc(),
            "virtual_routers": [
                {
                    "local_asn": vr.local_asn,
                    "export_pod_cidr": vr.export_pod_cidr,
                    "service_selector": (
                        None if vr.service_selector is None else vr.service_selector.to_doc()
                    ),
                    "router_id": vr.router_id,
                    "neighbors": [
                        {
                            "peer_address": n.peer_address,
                            "peer_asn": n.peer_asn,
                            "peer_port": n.peer_port,
                            "hold_time": n.hold_time,
                            "keep_alive": n.keep_alive,
                            "connect_retry": n.connect_retry,
                            "ebgp_multihop_ttl": n.ebgp_multihop_ttl,
                            "password": n.password,
                            "auth_secret_ref": n.auth_secret_ref,
                        }
                        for n in vr.neighbors
                    ],
                }
                for vr in self.virtual_routers
            ],
        }
        if self.source != "api":
            doc["source"] = self.source
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, revision: int = 0) -> PeeringPolicy:
        doc = json.loads(raw)

        def selector(value: Any) -> Selector | None:
            return None if value is None else Selector.from_doc(value)

        return cls(
            name=doc["name"],
            node_selector=selector(doc.get("node_selector")),
            virtual_routers=tuple(
                VirtualRouter(
                    local_asn=int(vr["local_asn"]),
                    export_pod_cidr=bool(vr.get("export_pod_cidr", False)),
                    service_selector=selector(vr.get("service_selector")),
                    router_id=vr.get("router_id", ""),
                    neighbors=tuple(
                        Neighbor(
                            peer_address=n["peer_address"],
                            peer_asn=int(n["peer_asn"]),
                            peer_port=int(n.get("peer_port", DEFAULT_PORT)),
                            hold_time=int(n.get("hold_time", DEFAULT_HOLD_TIME)),
                            keep_alive=int(n.get("keep_alive", DEFAULT_KEEP_ALIVE)),
                            connect_retry=int(n.get("connect_retry", DEFAULT_CONNECT_RETRY)),
                            ebgp_multihop_ttl=int(n.get("ebgp_multihop_ttl", 1)),
                            password=n.get("password", ""),
                            auth_secret_ref=n.get("auth_secret_ref", ""),
                        )
                        for n in vr.get("neighbors", ())
                    ),
                )
                for vr in doc.get("virtual_routers", ())
            ),
            source=doc.get("source", "api"),
            revision=revision,
        )


# --- validation ---


@dataclass(frozen=True)
class RawSelector:
    match_labels: Mapping[str, str] = field(default_factory=dict)
    match_expressions: Sequence[tuple[str, str, Sequence[str]]] = ()


@dataclass(frozen=True)
class RawNeighbor:
    peer_address: str = ""
    peer_asn: int = 0
    peer_port: int = 0
    hold_time: int = 0
    keep_alive: int = 0
    connect_retry: int = 0
    ebgp_multihop_ttl: int = 0
    password: str = ""
    auth_secret_ref: str = ""


@dataclass(frozen=True)
class RawVirtualRouter:
    local_asn: int = 0
    export_pod_cidr: bool = False
    service_selector: RawSelector | None = None
    neighbors: Sequence[RawNeighbor] = ()
    router_id: str = ""


@dataclass(frozen=True)
class RawPolicy:
    name: str
    node_selector: RawSelector | None = None
    virtual_routers: Sequence[RawVirtualRouter] = ()
    source: str = "api"


def validate_name(name: str, field: str = "policy.name") -> None:
    if not SHORT_NAME_RE.match(name) or ":" in name or "/" in name:
        raise InvalidArgument(
            f"{name!r} is not a policy name (lowercase letters, digits, '-', '.', at most 253)",
            field=field,
        )


def build_selector(raw: RawSelector, path: str) -> Selector:
    """Empty: every node (or service)."""
    labels, reqs = sel.build_selector(raw.match_labels, raw.match_expressions, path)
    return Selector(labels, reqs)


def _asn(value: int, field: str) -> int:
    if not 1 <= value <= MAX_ASN:
        raise InvalidArgument(f"{value} is not an ASN (1..{MAX_ASN})", field=field)
    return value


def _range(value: int, low: int, high: int, default: int, field: str) -> int:
    """0 (unset) is the default; else low..high."""
    if value == 0:
        return default
    if not low <= value <= high:
        raise InvalidArgument(f"{value} is out of range ({low}..{high}, or 0)", field=field)
    return value


def _peer_address(value: str, field: str) -> str:
    """An IP, or a host prefix of one (Cilium's peerAddress is a CIDR)."""
    if not value:
        raise InvalidArgument("a peer address is required", field=field)
    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError:
        raise InvalidArgument(f"{value!r} is not an IP address", field=field) from None
    if net.num_addresses != 1:
        raise InvalidArgument(f"{value!r} is not one address (/32 or /128)", field=field)
    ip = net.network_address
    if ip.is_unspecified or ip.is_multicast or ip.is_loopback:
        raise InvalidArgument(f"{value!r} cannot be a BGP peer", field=field)
    return str(ip)


def build_neighbor(raw: RawNeighbor, path: str) -> Neighbor:
    address = _peer_address(raw.peer_address, f"{path}.peer_address")
    hold = _range(raw.hold_time, 3, 65535, DEFAULT_HOLD_TIME, f"{path}.hold_time_seconds")
    keep_alive = _range(
        raw.keep_alive, 1, 65535, DEFAULT_KEEP_ALIVE, f"{path}.keep_alive_time_seconds"
    )
    if keep_alive > hold:
        raise InvalidArgument(
            f"{keep_alive} s is longer than the hold time ({hold} s)",
            field=f"{path}.keep_alive_time_seconds",
        )
    if len(raw.password) > MAX_PASSWORD:
        raise InvalidArgument(f"at most {MAX_PASSWORD} characters", field=f"{path}.password")
    if raw.password and not raw.password.isprintable():
        raise InvalidArgument("printable characters only", field=f"{path}.password")
    if raw.auth_secret_ref and not SHORT_NAME_RE.match(raw.auth_secret_ref):
        raise InvalidArgument(
            f"{raw.auth_secret_ref!r} is not a Secret name", field=f"{path}.auth_secret_ref"
        )
    return Neighbor(
        peer_address=address,
        peer_asn=_asn(raw.peer_asn, f"{path}.peer_asn"),
        peer_port=_range(raw.peer_port, 1, 65535, DEFAULT_PORT, f"{path}.peer_port"),
        hold_time=hold,
        keep_alive=keep_alive,
        connect_retry=_range(
            raw.connect_retry, 1, 65535, DEFAULT_CONNECT_RETRY, f"{path}.connect_retry_time_seconds"
        ),
        ebgp_multihop_ttl=_range(raw.ebgp_multihop_ttl, 1, 255, 1, f"{path}.ebgp_multihop_ttl"),
        password=raw.password,
        auth_secret_ref=raw.auth_secret_ref,
    )


def build_policy(raw: RawPolicy) -> PeeringPolicy:
    """Validate raw into a canonical PeeringPolicy. Raises InvalidArgument
    naming the field."""
    validate_name(raw.name)
    node_selector = (
        None
        if raw.node_selector is None
        else build_selector(raw.node_selector, "policy.node_selector")
    )
    if not raw.virtual_routers:
        raise InvalidArgument("at least one virtual router", field="policy.virtual_routers")
    if len(raw.virtual_routers) > MAX_VIRTUAL_ROUTERS:
        raise InvalidArgument(
            f"at most {MAX_VIRTUAL_ROUTERS} virtual routers", field="policy.virtual_routers"
        )
    routers: list[VirtualRouter] = []
    for i, vr in enumerate(raw.virtual_routers):
        path = f"policy.virtual_routers[{i}]"
        asn = _asn(vr.local_asn, f"{path}.local_asn")
        if any(r.local_asn == asn for r in routers):
            raise InvalidArgument(
                f"another virtual router has ASN {asn} already", field=f"{path}.local_asn"
            )
        router_id = ""
        if vr.router_id:
            try:
                router_id = str(ipaddress.IPv4Address(vr.router_id))
            except ValueError:
                raise InvalidArgument(
                    f"{vr.router_id!r} is not a router id (an IPv4 address)",
                    field=f"{path}.router_id",
                ) from None
            if router_id == "0.0.0.0":
                raise InvalidArgument("0.0.0.0 is not a router id", field=f"{path}.router_id")
        if len(vr.neighbors) > MAX_NEIGHBORS:
            raise InvalidArgument(f"at most {MAX_NEIGHBORS} neighbors", field=f"{path}.neighbors")
        neighbors: list[Neighbor] = []
        for j, n in enumerate(vr.neighbors):
            at = f"{path}.neighbors[{j}]"
            neighbor = build_neighbor(n, at)
            if any(m.peer_address == neighbor.peer_address for m in neighbors):
                raise InvalidArgument(
                    f"{neighbor.peer_address} is listed twice", field=f"{at}.peer_address"
                )
            neighbors.append(neighbor)
        routers.append(
            VirtualRouter(
                local_asn=asn,
                export_pod_cidr=vr.export_pod_cidr,
                service_selector=(
                    None
                    if vr.service_selector is None
                    else build_selector(vr.service_selector, f"{path}.service_selector")
                ),
                neighbors=tuple(neighbors),
                router_id=router_id,
            )
        )
    return PeeringPolicy(
        name=raw.name,
        node_selector=node_selector,
        virtual_routers=tuple(routers),
        source=raw.source,
    )


# --- Cilium's document ---


def _int(value: Any, path: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{value!r} is not an integer", field=path)
    return value


def _duration(value: Any, path: str) -> int:
    """Cilium's v2alpha1 timers are integers of seconds."""
    return _int(value, path)


def _raw_selector(value: Any, path: str) -> RawSelector | None:
    if value is None:
        return None
    labels, exprs = sel.selector_from_doc(value, path)
    return RawSelector(labels, exprs)


def raw_from_cilium(
    doc: Any, *, source: str = "api", secrets: Mapping[str, str] | None = None
) -> RawPolicy:
    """A CiliumBGPPeeringPolicy object (cilium.io/v2alpha1) as plain values;
    its structure's errors name the field by the document's path, the
    values' by the policy's (build_policy). secrets: authSecretRef -> the
    password it holds (a reference without one is refused; None: not from
    Kubernetes, every reference refused)."""
    meta, spec = cilium_object(doc, "CiliumBGPPeeringPolicy")
    routers: list[RawVirtualRouter] = []
    vrs_path = "document.spec.virtualRouters"
    for i, item in enumerate(doc_list(spec.get("virtualRouters"), vrs_path)):
        path = f"{vrs_path}[{i}]"
        vr = doc_object(item, path)
        neighbors: list[RawNeighbor] = []
        for j, n_item in enumerate(doc_list(vr.get("neighbors"), f"{path}.neighbors")):
            at = f"{path}.neighbors[{j}]"
            n = doc_object(n_item, at)
            ref = str(n.get("authSecretRef") or "")
            password = ""
            if ref and secrets is None:
                raise InvalidArgument(
                    "Secret references are read from Kubernetes only", field=f"{at}.authSecretRef"
                )
            if ref:
                found = (secrets or {}).get(ref)
                if found is None:
                    raise InvalidArgument(
                        f"no Secret {ref!r} with a key 'password'", field=f"{at}.authSecretRef"
                    )
                password = found
            neighbors.append(
                RawNeighbor(
                    peer_address=str(n.get("peerAddress") or ""),
                    peer_asn=_int(n.get("peerASN"), f"{at}.peerASN"),
                    peer_port=_int(n.get("peerPort"), f"{at}.peerPort"),
                    hold_time=_duration(n.get("holdTimeSeconds"), f"{at}.holdTimeSeconds"),
                    keep_alive=_duration(
                        n.get("keepAliveTimeSeconds"), f"{at}.keepAliveTimeSeconds"
                    ),
                    connect_retry=_duration(
                        n.get("connectRetryTimeSeconds"), f"{at}.connectRetryTimeSeconds"
                    ),
                    ebgp_multihop_ttl=_int(n.get("eBGPMultihopTTL"), f"{at}.eBGPMultihopTTL"),
                    password=password,
                    auth_secret_ref=ref,
                )
            )
        routers.append(
            RawVirtualRouter(
                local_asn=_int(vr.get("localASN"), f"{path}.localASN"),
                export_pod_cidr=bool(vr.get("exportPodCIDR", False)),
                service_selector=_raw_selector(
                    vr.get("serviceSelector"), f"{path}.serviceSelector"
                ),
                neighbors=neighbors,
                router_id=str(vr.get("routerID") or ""),
            )
        )
    return RawPolicy(
        name=str(meta.get("name") or ""),
        node_selector=_raw_selector(spec.get("nodeSelector"), "document.spec.nodeSelector"),
        virtual_routers=routers,
        source=source,
    )


def secret_refs(doc: Any) -> set[str]:
    """The authSecretRefs a CiliumBGPPeeringPolicy object names (best
    effort: its structure is checked by raw_from_cilium)."""
    refs: set[str] = set()
    spec = doc.get("spec") if isinstance(doc, Mapping) else None
    routers = spec.get("virtualRouters") if isinstance(spec, Mapping) else None
    for vr in routers if isinstance(routers, list) else []:
        neighbors = vr.get("neighbors") if isinstance(vr, Mapping) else None
        for n in neighbors if isinstance(neighbors, list) else []:
            if isinstance(n, Mapping) and n.get("authSecretRef"):
                refs.add(str(n["authSecretRef"]))
    return refs
