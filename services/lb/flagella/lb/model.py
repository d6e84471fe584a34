"""Domain model of the lb service: a service as asked for (ServiceSpec) and as
stored with its ids (ServiceRecord), with their JSON form in etcd.

A service is keyed by name ("namespace/name", or "name" for no namespace).
It has one frontend (address, port, protocol), is ClusterIP or NodePort (the
node port on every node address), and has backends. Backends are per service:
a backend is (address, port) within its service, with the service's
protocol, and gets a backend id of its own that no other service shares (see
docs/lb.md for why this differs from Cilium's shared backends).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flagella.lb.maglev import MaglevBackend, backend_key

DEFAULT_AFFINITY_TIMEOUT_S = 10800  # Kubernetes' default
MAX_AFFINITY_TIMEOUT_S = 86400  # Kubernetes' maximum


class Protocol(enum.Enum):
    TCP = "TCP"
    UDP = "UDP"


class ServiceType(enum.Enum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"


class Algorithm(enum.Enum):
    RANDOM = "random"
    MAGLEV = "maglev"


class BackendState(enum.Enum):
    ACTIVE = "active"
    # Keeps its established connections, gets no new ones.
    TERMINATING = "terminating"
    QUARANTINED = "quarantined"
    MAINTENANCE = "maintenance"


class TrafficPolicy(enum.Enum):
    """externalTrafficPolicy: which nodes serve node ports, LoadBalancer
    addresses and external IPs, and over which backends."""

    CLUSTER = "Cluster"
    # Only a node's own backends, the client's address kept; a node without
    # one drops.
    LOCAL = "Local"


class Source(enum.Enum):
    API = "api"
    KUBERNETES = "kubernetes"


@dataclass(frozen=True, slots=True)
class Frontend:
    address: str  # canonical text form
    port: int
    protocol: Protocol

    @property
    def family(self) -> int:
        return 6 if ":" in self.address else 4


@dataclass(frozen=True, slots=True)
class BackendSpec:
    address: str
    port: int
    weight: int = 1
    state: BackendState = BackendState.ACTIVE
    node: str = ""

    @property
    def key(self) -> tuple[str, int]:
        """What identifies a backend within its service."""
        return (self.address, self.port)


@dataclass(frozen=True, slots=True)
class Backend:
    """A backend with its id, as stored."""

    id: int
    address: str
    port: int
    weight: int = 1
    state: BackendState = BackendState.ACTIVE
    node: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.address, self.port)

    def spec(self) -> BackendSpec:
        return BackendSpec(self.address, self.port, self.weight, self.state, self.node)


@dataclass(frozen=True, slots=True)
class Affinity:
    """ClientIP session affinity: a client's new connections go to the backend
    of its last one until timeout_s without traffic."""

    timeout_s: int = DEFAULT_AFFINITY_TIMEOUT_S


@dataclass(frozen=True)
class ServiceSpec:
    """A service as asked for, validated and in canonical form."""

    name: str
    namespace: str
    frontend: Frontend
    type: ServiceType = ServiceType.CLUSTER_IP
    # NodePort: 0 asks for one from the configured range (kept on update).
    node_port: int = 0
    backends: tuple[BackendSpec, ...] = ()
    algorithm: Algorithm = Algorithm.RANDOM
    maglev_table_size: int = 0  # 0: the configured default
    affinity: Affinity | None = None
    source_ranges: tuple[str, ...] = ()
    source: Source = Source.API
    # Sorted (key, value) pairs: what policy toServices selectors match.
    labels: tuple[tuple[str, str], ...] = ()
    external_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    # spec.externalIPs (canonical text, the caller's order): served on every
    # node at the frontend's port and protocol.
    external_ips: tuple[str, ...] = ()
    # spec.healthCheckNodePort (eTP Local with external traffic); 0: none.
    health_check_node_port: int = 0

    def external_frontends(self) -> tuple[Frontend, ...]:
        return external_frontends(self.frontend, self.external_ips)


def external_frontends(frontend: Frontend, external_ips: Sequence[str]) -> tuple[Frontend, ...]:
    """The frontends an external IP adds: its address at the service's port
    and protocol (each held in the frontend index as a frontend is)."""
    return tuple(Frontend(ip, frontend.port, frontend.protocol) for ip in external_ips)


@dataclass(frozen=True)
class ServiceRecord:
    """A service as stored under flagella/lb/v1/services/<id>."""

    name: str
    namespace: str
    id: int
    rev_nat_id: int
    frontend: Frontend
    type: ServiceType
    node_port: int
    backends: tuple[Backend, ...]
    algorithm: Algorithm
    maglev_table_size: int
    affinity: Affinity | None
    source_ranges: tuple[str, ...]
    source: Source
    # Backend-id blocks this service owns (see ids.py).
    backend_blocks: tuple[int, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    # LB-IPAM's addresses of a LoadBalancer service (lbipam_store.py sets
    # them): extra frontends on every node, at the frontend's port.
    external: tuple[str, ...] = ()
    external_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    external_ips: tuple[str, ...] = ()
    health_check_node_port: int = 0
    # etcd mod revision of the record (not stored in the value).
    revision: int = field(default=0, compare=False)

    def with_revision(self, revision: int) -> ServiceRecord:
        # A copy of the fields as they are (dataclasses.replace would run
        # __init__ through every field: 5 µs of a bulk's per-service cost).
        copy = object.__new__(ServiceRecord)
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "revision", revision)
        return copy

    def same_spec(self, spec: ServiceSpec) -> bool:
        """Whether storing spec would change nothing."""
        return (
            self.namespace == spec.namespace
            and self.frontend == spec.frontend
            and self.type == spec.type
            and (spec.node_port in (0, self.node_port))
            and tuple(b.spec() for b in self.backends) == spec.backends
            and self.algorithm == spec.algorithm
            and self.maglev_table_size == spec.maglev_table_size
            and self.affinity == spec.affinity
            and self.source_ranges == spec.source_ranges
            and self.source == spec.source
            and self.labels == spec.labels
            and self.external_traffic_policy == spec.external_traffic_policy
            and self.external_ips == spec.external_ips
            and self.health_check_node_port == spec.health_check_node_port
        )

    def external_frontends(self) -> tuple[Frontend, ...]:
        return external_frontends(self.frontend, self.external_ips)

    def maglev_backends(self) -> list[MaglevBackend]:
        """The backends that get new flows, as the Maglev table sees them."""
        proto = self.frontend.protocol.value
        return [
            MaglevBackend(backend_key(b.address, b.port, proto), b.id, b.weight)
            for b in self.backends
            if b.state is BackendState.ACTIVE
        ]

    def backend_ids(self) -> set[int]:
        return {b.id for b in self.backends}

    # --- JSON ---

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "id": self.id,
            "rev_nat_id": self.rev_nat_id,
            "frontend": {
                "address": self.frontend.address,
                "port": self.frontend.port,
                "protocol": self.frontend.protocol.value,
            },
            "type": self.type.value,
            "node_port": self.node_port,
            "backends": [
                {
                    "id": b.id,
                    "address": b.address,
                    "port": b.port,
                    "weight": b.weight,
                    "state": b.state.value,
                    "node": b.node,
                }
                for b in self.backends
            ],
            "algorithm": self.algorithm.value,
            "maglev_table_size": self.maglev_table_size,
            "affinity": None if self.affinity is None else {"timeout_s": self.affinity.timeout_s},
            "source_ranges": list(self.source_ranges),
            "source": self.source.value,
            "backend_blocks": list(self.backend_blocks),
        }
        if self.labels:
            # Absent without labels: records stored before labels read back the same.
            doc["labels"] = dict(self.labels)
        if self.external:
            doc["external"] = list(self.external)
        # Absent when default, as labels: older records read back the same.
        if self.external_traffic_policy is not TrafficPolicy.CLUSTER:
            doc["external_traffic_policy"] = self.external_traffic_policy.value
        if self.external_ips:
            doc["external_ips"] = list(self.external_ips)
        if self.health_check_node_port:
            doc["health_check_node_port"] = self.health_check_node_port
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, revision: int = 0) -> ServiceRecord:
        doc = json.loads(raw)
        fe: Mapping[str, Any] = doc["frontend"]
        aff = doc.get("affinity")
        backends: Sequence[Mapping[str, Any]] = doc.get("backends", [])
        return cls(
            name=doc["name"],
            namespace=doc.get("namespace", ""),
            id=int(doc["id"]),
            rev_nat_id=int(doc["rev_nat_id"]),
            frontend=Frontend(fe["address"], int(fe["port"]), Protocol(fe["protocol"])),
            type=ServiceType(doc["type"]),
            node_port=int(doc.get("node_port", 0)),
            backends=tuple(
                Backend(
                    id=int(b["id"]),
                    address=b["address"],
                    port=int(b["port"]),
                    weight=int(b.get("weight", 1)),
                    state=BackendState(b.get("state", "active")),
                    node=b.get("node", ""),
                )
                for b in backends
            ),
            algorithm=Algorithm(doc["algorithm"]),
            maglev_table_size=int(doc.get("maglev_table_size", 0)),
            affinity=None if aff is None else Affinity(int(aff["timeout_s"])),
            source_ranges=tuple(doc.get("source_ranges", ())),
            source=Source(doc.get("source", "api")),
            backend_blocks=tuple(int(b) for b in doc.get("backend_blocks", ())),
            labels=tuple(sorted(doc.get("labels", {}).items())),
            external=tuple(doc.get("external", ())),
            external_traffic_policy=TrafficPolicy(doc.get("external_traffic_policy", "Cluster")),
            external_ips=tuple(doc.get("external_ips", ())),
            health_check_node_port=int(doc.get("health_check_node_port", 0)),
            revision=revision,
        )


def split_name(name: str) -> tuple[str, str]:
    """("namespace", "name") of a service key."""
    ns, sep, short = name.rpartition("/")
    return (ns, short) if sep else ("", name)
