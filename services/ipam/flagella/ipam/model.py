"""Domain types of the ipam service (no gRPC, no etcd)."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

from flagella.ipam.pool import IPAddress, IPNetwork


class Family(enum.IntEnum):
    IPV4 = 4
    IPV6 = 6

    @property
    def label(self) -> str:
        return "IPv4" if self is Family.IPV4 else "IPv6"

    @property
    def key(self) -> str:
        return "v4" if self is Family.IPV4 else "v6"

    @classmethod
    def of(cls, ip: IPAddress | IPNetwork) -> Family:
        return cls(ip.version)


class Mode(enum.Enum):
    CLUSTER_POOL = "cluster-pool"
    HOST_SCOPE = "host-scope"


class AddressType(enum.Enum):
    INTERNAL_IP = "InternalIP"
    EXTERNAL_IP = "ExternalIP"


@dataclass(frozen=True, slots=True)
class NodeAddress:
    type: AddressType
    ip: str


@dataclass(frozen=True, slots=True)
class Owner:
    """One interface of one container. Identity is (container_id, ifname);
    pod is informational."""

    container_id: str
    ifname: str
    pod: str = ""

    @property
    def ident(self) -> tuple[str, str]:
        return (self.container_id, self.ifname)

    def __str__(self) -> str:
        return f"{self.container_id}/{self.ifname}"


@dataclass(frozen=True, slots=True)
class Allocation:
    ip: IPAddress
    node: str
    owner: Owner
    cidr: IPNetwork
    allocated_at: float
    # Unix time the reservation expires; None once committed (or never set).
    expires_at: float | None = None
    revision: int = 0

    @property
    def family(self) -> Family:
        return Family.of(self.ip)

    @property
    def committed(self) -> bool:
        return self.expires_at is None


@dataclass(frozen=True, slots=True)
class NodeRegistration:
    """What a node registers; pod_cidrs are filled in by the service."""

    name: str
    addresses: tuple[NodeAddress, ...] = ()
    datapath_address: str = ""
    pod_cidrs: tuple[IPNetwork, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    # Seconds; 0: the service default.
    lease_ttl: int = 0


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    addresses: tuple[NodeAddress, ...]
    datapath_address: str
    pod_cidrs: tuple[IPNetwork, ...]
    labels: dict[str, str]
    lease_ttl: int
    registered_at: float
    # Its node id (1..65535), cluster-wide, kept while its CIDRs are.
    id: int = 0
    revision: int = 0
    # The etcd lease its entry is on (not stored in the value: the key's).
    lease: int = 0


@dataclass(frozen=True, slots=True)
class PoolUsage:
    node: str
    cidr: IPNetwork
    allocated: int
    capacity: int


@dataclass(frozen=True, slots=True)
class Status:
    mode: Mode
    cluster_cidrs: tuple[IPNetwork, ...]
    node_mask_size_v4: int
    node_mask_size_v6: int
    pools: tuple[PoolUsage, ...]


def sort_key(ip: IPAddress | IPNetwork) -> tuple[int, int]:
    if isinstance(ip, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return (ip.version, int(ip.network_address))
    return (ip.version, int(ip))
