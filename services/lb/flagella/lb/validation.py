"""Validation of a service as asked for, into its canonical ServiceSpec.

Every check raises InvalidArgument naming the field by its path in
UpsertServiceRequest ("service.backends[2].weight"), so the gRPC API and the
Kubernetes watcher reject the same things the same way.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from flagella.common.errors import FlagellaError, InvalidArgument
from flagella.lb.maglev import SUPPORTED_SIZES, supported_sizes_text
from flagella.lb.model import (
    MAX_AFFINITY_TIMEOUT_S,
    Affinity,
    Algorithm,
    BackendSpec,
    BackendState,
    Frontend,
    Protocol,
    ServiceSpec,
    ServiceType,
    Source,
    TrafficPolicy,
)

MIN_WEIGHT = 1
MAX_WEIGHT = 100
MAX_SOURCE_RANGES = 256
# A node serves each external IP as a frontend of its own, numbered in the
# datapath's rev-NAT ids (frontend index < 256, with the node addresses).
MAX_EXTERNAL_IPS = 64
# DNS-1123 label, as Kubernetes namespaces.
NAMESPACE_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# A DNS-1123 subdomain, plus ':' (the Kubernetes watcher names a service
# "<namespace>/<service>:<port name>").
SHORT_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.:_-]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class Limits:
    """What the configuration allows."""

    node_port_min: int = 30000
    node_port_max: int = 32767
    max_backends: int = 2048
    default_algorithm: Algorithm = Algorithm.RANDOM
    default_table_size: int = 16381


@dataclass(frozen=True)
class RawBackend:
    address: str
    port: int
    weight: int = 0  # 0: the default (1)
    state: BackendState | None = None  # None: active
    node: str = ""


@dataclass(frozen=True)
class RawService:
    """A service as a caller gives it, before validation (enums already
    mapped; None for "unspecified")."""

    name: str
    namespace: str = ""
    frontend_address: str = ""
    frontend_port: int = 0
    protocol: Protocol | None = None
    type: ServiceType | None = None
    node_port: int = 0
    backends: Sequence[RawBackend] = ()
    algorithm: Algorithm | None = None
    maglev_table_size: int = 0
    client_ip_affinity: bool = False
    # (seconds, nanos) when given.
    affinity_timeout: tuple[int, int] | None = None
    source_ranges: Sequence[str] = ()
    source: Source = Source.API
    labels: Mapping[str, str] | None = None
    external_traffic_policy: TrafficPolicy | None = None  # None: Cluster
    external_ips: Sequence[str] = ()
    # Whether the request is a LoadBalancer one (load_balancer set): what
    # makes externalTrafficPolicy Local meaningful besides a node port and
    # external IPs.
    load_balancer: bool = False
    health_check_node_port: int = 0


def check_ip(value: str, field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if not value:
        raise InvalidArgument("an IPv4 or IPv6 address is required", field=field)
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        raise InvalidArgument(f"{value!r} is not an IPv4 or IPv6 address", field=field) from None
    if ip.is_unspecified or ip.is_multicast:
        kind = "unspecified" if ip.is_unspecified else "multicast"
        raise InvalidArgument(f"{value!r} is a {kind} address", field=field)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        raise InvalidArgument(f"{value!r} is IPv4-mapped: give the IPv4 address", field=field)
    return ip


def canonical_ip(value: str, field: str) -> tuple[str, int, int]:
    """check_ip's address as (canonical text, family, integer value). An
    IPv4 address is read by inet_pton, which takes only the canonical
    dotted quad (no leading zeros, four parts), about five times faster than
    ipaddress: a bulk of 10,000 services has ~40,000 addresses."""
    try:
        packed = socket.inet_pton(socket.AF_INET, value)
    except (OSError, ValueError):
        ip = check_ip(value, field)
        return str(ip), ip.version, int(ip)
    number = int.from_bytes(packed, "big")
    if number == 0:
        raise InvalidArgument(f"{value!r} is a unspecified address", field=field)
    if 224 <= packed[0] <= 239:
        raise InvalidArgument(f"{value!r} is a multicast address", field=field)
    return value, 4, number


def check_port(value: int, field: str) -> int:
    if not 1 <= value <= 65535:
        raise InvalidArgument(f"{value} is not a port (1-65535)", field=field)
    return value


def validate_frontend(
    address: str, port: int, protocol: Protocol | None, field: str = "service.frontend"
) -> Frontend:
    """A frontend in canonical form (protocol unspecified: TCP)."""
    text, _, _ = canonical_ip(address, f"{field}.address")
    return Frontend(text, check_port(port, f"{field}.port"), protocol or Protocol.TCP)


def lookup_name(name: str, field: str = "name") -> str:
    """A service's name to look it up by: one a service could have (a
    megabyte one is no key: etcd refuses the read)."""
    try:
        validate_name(name, "")
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, field=field) from None
    return name


def validate_name(name: str, namespace: str) -> tuple[str, str]:
    """The key ("namespace/name" or "name") and namespace of a service."""
    if not name:
        raise InvalidArgument("a name is required", field="service.name")
    ns, sep, short = name.partition("/")
    if sep:
        if namespace and namespace != ns:
            raise InvalidArgument(
                f"namespace {namespace!r} differs from the one in name {name!r}",
                field="service.namespace",
            )
    else:
        ns, short = namespace, name
    if ns and not NAMESPACE_RE.match(ns):
        raise InvalidArgument(
            f"{ns!r} is not a valid namespace (lowercase letters, digits and '-', at most 63)",
            field="service.namespace" if not sep else "service.name",
        )
    if not SHORT_NAME_RE.match(short):
        raise InvalidArgument(
            f"{short!r} is not a valid service name (lowercase letters, digits, "
            "'-', '.', ':', '_'; at most 253; in the form namespace/name or name)",
            field="service.name",
        )
    return (f"{ns}/{short}" if ns else short), ns


def build_spec(raw: RawService, limits: Limits) -> ServiceSpec:
    """Validate raw into a canonical ServiceSpec. Raises InvalidArgument."""
    name, namespace = validate_name(raw.name, raw.namespace)

    frontend = validate_frontend(raw.frontend_address, raw.frontend_port, raw.protocol)
    fe_version = frontend.family

    svc_type = raw.type or ServiceType.CLUSTER_IP
    node_port = raw.node_port
    if svc_type is ServiceType.NODE_PORT:
        if node_port and not limits.node_port_min <= node_port <= limits.node_port_max:
            raise InvalidArgument(
                f"{node_port} is outside the node port range "
                f"{limits.node_port_min}-{limits.node_port_max}",
                field="service.node_port",
            )
    elif node_port:
        raise InvalidArgument("only NodePort services have a node port", field="service.node_port")

    if len(raw.backends) > limits.max_backends:
        raise InvalidArgument(
            f"{len(raw.backends)} backends: at most {limits.max_backends} per service",
            field="service.backends",
        )
    seen: dict[tuple[str, int], int] = {}
    ordered: list[tuple[int, BackendSpec]] = []
    for i, rb in enumerate(raw.backends):
        path = f"service.backends[{i}]"
        address, version, number = canonical_ip(rb.address, f"{path}.address")
        if version != fe_version:
            raise InvalidArgument(
                f"{rb.address!r} is IPv{version} but the frontend is IPv{fe_version}",
                field=f"{path}.address",
            )
        port = check_port(rb.port, f"{path}.port")
        weight = rb.weight or MIN_WEIGHT
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise InvalidArgument(
                f"{rb.weight} is not a weight ({MIN_WEIGHT}-{MAX_WEIGHT}; 0 means 1)",
                field=f"{path}.weight",
            )
        key = (address, port)
        if key in seen:
            raise InvalidArgument(f"{key[0]}:{port} is already backend {seen[key]}", field=path)
        seen[key] = i
        if len(rb.node) > 253:
            raise InvalidArgument("node name longer than 253", field=f"{path}.node")
        spec = BackendSpec(address, port, weight, rb.state or BackendState.ACTIVE, rb.node)
        ordered.append((number, spec))
    # Canonical order: the same set of backends is the same service, whatever
    # order a caller lists them in.
    ordered.sort(key=lambda t: (t[0], t[1].port))

    algorithm = raw.algorithm or limits.default_algorithm
    table_size = raw.maglev_table_size or limits.default_table_size
    if table_size not in SUPPORTED_SIZES:
        raise InvalidArgument(
            f"{table_size} is not a supported Maglev table size ({supported_sizes_text()})",
            field="service.maglev_table_size",
        )

    affinity: Affinity | None = None
    if raw.client_ip_affinity:
        affinity = Affinity()
        if raw.affinity_timeout is not None:
            seconds, nanos = raw.affinity_timeout
            if nanos or not 1 <= seconds <= MAX_AFFINITY_TIMEOUT_S:
                raise InvalidArgument(
                    f"{seconds}s{f' {nanos}ns' if nanos else ''} is not a timeout "
                    f"(whole seconds, 1-{MAX_AFFINITY_TIMEOUT_S})",
                    field="service.session_affinity.timeout",
                )
            affinity = replace(affinity, timeout_s=seconds)
    elif raw.affinity_timeout is not None:
        raise InvalidArgument(
            "a timeout needs ClientIP session affinity",
            field="service.session_affinity.timeout",
        )

    if len(raw.source_ranges) > MAX_SOURCE_RANGES:
        raise InvalidArgument(
            f"at most {MAX_SOURCE_RANGES} source ranges", field="service.source_ranges"
        )
    ranges: dict[str, ipaddress.IPv4Network | ipaddress.IPv6Network] = {}
    for i, cidr in enumerate(raw.source_ranges):
        path = f"service.source_ranges[{i}]"
        try:
            net = ipaddress.ip_network(cidr.strip(), strict=False)
        except ValueError:
            raise InvalidArgument(f"{cidr!r} is not a CIDR", field=path) from None
        if net.version != fe_version:
            raise InvalidArgument(
                f"{cidr!r} is IPv{net.version} but the frontend is IPv{fe_version}",
                field=path,
            )
        ranges[str(net)] = net
    source_ranges = tuple(
        str(n) for n in sorted(ranges.values(), key=lambda n: (int(n.network_address), n.prefixlen))
    )

    labels = _labels(raw.labels or {})
    external_ips = _external_ips(raw.external_ips, frontend)
    policy = raw.external_traffic_policy or TrafficPolicy.CLUSTER
    if (
        policy is TrafficPolicy.LOCAL
        and svc_type is not ServiceType.NODE_PORT
        and not raw.load_balancer
        and not external_ips
    ):
        # As the Kubernetes API server: only externally reachable services
        # have external traffic.
        raise InvalidArgument(
            "Local applies to external traffic only: the service needs a node port "
            "(type NodePort), a LoadBalancer request or external IPs",
            field="service.external_traffic_policy",
        )
    health_check = raw.health_check_node_port
    if health_check:
        if policy is not TrafficPolicy.LOCAL:
            raise InvalidArgument(
                "a health check node port is for externalTrafficPolicy Local only",
                field="service.health_check_node_port",
            )
        if not limits.node_port_min <= health_check <= limits.node_port_max:
            raise InvalidArgument(
                f"{health_check} is outside the node port range "
                f"{limits.node_port_min}-{limits.node_port_max}",
                field="service.health_check_node_port",
            )
        if svc_type is ServiceType.NODE_PORT and health_check == node_port:
            raise InvalidArgument(
                f"{health_check} is the service's own node port",
                field="service.health_check_node_port",
            )
    return ServiceSpec(
        name=name,
        namespace=namespace,
        frontend=frontend,
        type=svc_type,
        node_port=node_port,
        backends=tuple(b for _, b in ordered),
        algorithm=algorithm,
        maglev_table_size=table_size,
        affinity=affinity,
        source_ranges=source_ranges,
        source=raw.source,
        labels=labels,
        external_traffic_policy=policy,
        external_ips=external_ips,
        health_check_node_port=health_check,
    )


def _external_ips(values: Sequence[str], frontend: Frontend) -> tuple[str, ...]:
    """spec.externalIPs in canonical form, in the caller's order (so that an
    error's index and a conflict's name the caller's item)."""
    if len(values) > MAX_EXTERNAL_IPS:
        raise InvalidArgument(
            f"{len(values)} external IPs: at most {MAX_EXTERNAL_IPS}", field="service.external_ips"
        )
    seen: dict[str, int] = {}
    for i, value in enumerate(values):
        path = f"service.external_ips[{i}]"
        ip = check_ip(value, path)
        if ip.version != frontend.family:
            # Served at the frontend's port by the same backends: NAT46 is
            # not offered (as for node ports).
            raise InvalidArgument(
                f"{value!r} is IPv{ip.version} but the frontend is IPv{frontend.family}",
                field=path,
            )
        text = str(ip)
        if text == frontend.address:
            raise InvalidArgument(f"{text} is the service's frontend address", field=path)
        if text in seen:
            raise InvalidArgument(f"{text} is also external_ips[{seen[text]}]", field=path)
        seen[text] = i
    return tuple(seen)


MAX_LABELS = 64
# Kubernetes label syntax: an optional DNS-subdomain prefix, then a name.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY_RE = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
LABEL_VALUE_RE = re.compile(rf"^({_LABEL_NAME})?$")


def _labels(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels", field="service.labels")
    for key, value in labels.items():
        if not LABEL_KEY_RE.match(key):
            raise InvalidArgument(f"{key!r} is not a label key", field=f"service.labels[{key}]")
        if not LABEL_VALUE_RE.match(value):
            raise InvalidArgument(f"{value!r} is not a label value", field=f"service.labels[{key}]")
    return tuple(sorted(labels.items()))


MAX_BATCH = 1000


def in_batch(exc: FlagellaError, index: int) -> FlagellaError:
    """The error of one service of an UpsertServices batch, its field moved
    from service.<...> to services[index].<...>."""
    field = exc.field or "service"
    if field == "service" or field.startswith("service."):
        field = f"services[{index}]" + field[len("service") :]
    else:
        field = f"services[{index}].{field}"
    return type(exc)(exc.message, field=field)


def check_batch(specs: Sequence[ServiceSpec]) -> None:
    """Names, frontends and explicit node ports must be distinct within one
    batch (each belongs to one service)."""
    names: dict[str, int] = {}
    frontends: dict[Frontend, int] = {}
    external: dict[Frontend, int] = {}
    node_ports: dict[tuple[Protocol, int], int] = {}
    for i, spec in enumerate(specs):
        for j, fe in enumerate(spec.external_frontends()):
            other = frontends.get(fe, external.get(fe))
            if other is not None:
                raise InvalidArgument(
                    f"{fe.address} port {fe.port}/{fe.protocol.value} is also served by "
                    f"services[{other}]",
                    field=f"services[{i}].external_ips[{j}]",
                )
            external[fe] = i
        if spec.name in names:
            raise InvalidArgument(
                f"{spec.name!r} is also services[{names[spec.name]}]", field=f"services[{i}].name"
            )
        names[spec.name] = i
        if spec.frontend in frontends or spec.frontend in external:
            other = frontends.get(spec.frontend, external.get(spec.frontend))
            raise InvalidArgument(
                f"the frontend is also served by services[{other}]",
                field=f"services[{i}].frontend",
            )
        frontends[spec.frontend] = i
        if spec.type is ServiceType.NODE_PORT and spec.node_port:
            np = (spec.frontend.protocol, spec.node_port)
            if np in node_ports:
                raise InvalidArgument(
                    f"node port {spec.node_port} is also that of services[{node_ports[np]}]",
                    field=f"services[{i}].node_port",
                )
            node_ports[np] = i
