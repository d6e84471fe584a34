"""Checks of request fields: what the servicer validates before it calls
the service, which trusts its typed inputs."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import replace

from flagella.common.errors import InvalidArgument
from flagella.common.portnames import check_named_ports
from flagella.policy import keys
from flagella.policy.identities import (
    RESERVED_NAMES,
    format_prefix,
    parse_prefix,
    reserved_identity_of,
)
from flagella.policy.labels import (
    SOURCE_CIDR,
    SOURCE_RESERVED,
    Label,
    LabelError,
    LabelFilter,
    LabelSet,
    label_set,
)
from flagella.policy.rules import Rule, check_unique
from flagella.policy.state import IPEntry


def check_node(node: str, field: str = "node") -> str:
    if not node:
        raise InvalidArgument("required", field=field)
    if not keys.NODE_RE.match(node):
        raise InvalidArgument(f"{node!r} is not a valid node name", field=field)
    return node


MAX_OWNER = 253


def check_owner(owner: str, field: str = "owner") -> str:
    """An owner is free text (e.g. "<container id>/<ifname>"), up to
    MAX_OWNER characters, printable; empty means anonymous."""
    if len(owner) > MAX_OWNER:
        raise InvalidArgument(f"longer than {MAX_OWNER} characters", field=field)
    if not owner.isprintable():
        raise InvalidArgument(f"{owner!r} has unprintable characters", field=field)
    return owner


# The longest name a rule or CIDR group is kept under: a Kubernetes kind,
# a namespace (a DNS label) and a name (a DNS subdomain).
MAX_KEY = 64 + 1 + 63 + 1 + 253


def check_key(name: str, field: str = "name") -> str:
    """A rule's or CIDR group's name to look up or delete: required and no
    longer than any kept (a megabyte one is no key: etcd refuses the read)."""
    if not name:
        raise InvalidArgument("required", field=field)
    if len(name) > MAX_KEY:
        raise InvalidArgument(f"longer than {MAX_KEY} characters", field=field)
    return name


def check_prefix(text: str, field: str) -> str:
    if not text:
        raise InvalidArgument("required", field=field)
    try:
        return format_prefix(parse_prefix(text))
    except ValueError as exc:
        raise InvalidArgument(f"{text!r} is not an IP or CIDR ({exc})", field=field) from None


def identity_labels(
    labels: Iterable[Label], label_filter: LabelFilter, field: str = "labels"
) -> LabelSet:
    """The identity-relevant labels of a label list, validated."""
    try:
        ls = label_filter.filter(label_set(labels))
    except ValueError as exc:
        raise InvalidArgument(str(exc), field=field) from None
    if not ls:
        raise InvalidArgument("no identity-relevant labels", field=field)
    reserved = [lb for lb in ls if lb.source == SOURCE_RESERVED]
    if reserved and (len(ls) != 1 or reserved_identity_of(ls) is None):
        raise InvalidArgument(
            "a reserved label stands alone and names one of "
            + ", ".join(sorted(RESERVED_NAMES.values())),
            field=field,
        )
    return ls


def check_allocatable(labels: LabelSet, field: str = "labels") -> LabelSet:
    """Labels an identity can be allocated for: not a CIDR identity's."""
    if any(lb.source == SOURCE_CIDR for lb in labels):
        raise InvalidArgument("CIDR identities are local: they come from CIDR rules", field=field)
    return labels


def lookup_labels(labels: Iterable[Label], label_filter: LabelFilter, field: str) -> LabelSet:
    """The identity-relevant labels to look an identity up by (or trace)."""
    try:
        ls = label_filter.filter(label_set(labels))
    except LabelError as exc:
        raise InvalidArgument(str(exc), field=field) from None
    if not ls:
        raise InvalidArgument("no identity-relevant labels", field=field)
    return ls


def check_ip_entry(entry: IPEntry, named_ports: Sequence[tuple[str, int, str]] = ()) -> IPEntry:
    """An ipcache entry to upsert, its prefix normalized, with its named
    ports ((name, port, protocol name) as given)."""
    ports, where, reason = check_named_ports(named_ports)
    if where:
        raise InvalidArgument(reason, field=f"entry.named_ports{where}")
    prefix = check_prefix(entry.prefix, "entry.prefix")
    if entry.identity == 0:
        raise InvalidArgument("required", field="entry.identity")
    if entry.node:
        check_node(entry.node, "entry.node")
    if entry.host_ip:
        try:
            host_ip = format_prefix(parse_prefix(entry.host_ip))
        except ValueError:
            raise InvalidArgument(
                f"{entry.host_ip!r} is not an IP address", field="entry.host_ip"
            ) from None
        if "/" in host_ip:
            raise InvalidArgument(f"{entry.host_ip!r} is not an IP address", field="entry.host_ip")
    return replace(entry, prefix=prefix, named_ports=tuple(ports))


def check_rules(rules: Sequence[Rule]) -> Sequence[Rule]:
    """Rules to put in one transaction: at least one, at most
    MAX_RULES_PER_PUT, each name once."""
    if not rules:
        raise InvalidArgument("no rules given", field="rules")
    check_unique([("", r) for r in rules])
    return rules


# --- FQDN cache ---

MAX_FQDN_ENTRIES = 100
# Cilium's tofqdns-endpoint-max-ip-per-hostname.
MAX_FQDN_IPS = 1000
MAX_FQDN_TTL = 7 * 24 * 3600


def check_fqdn_endpoint(endpoint: str, field: str) -> str:
    if not endpoint:
        raise InvalidArgument("required", field=field)
    return check_owner(endpoint, field)


def check_fqdn_ips(ips: Sequence[str], field: str) -> tuple[str, ...]:
    """The addresses of an answer: bare IPs, at most MAX_FQDN_IPS, each once."""
    if not ips:
        raise InvalidArgument("required (an answer without addresses is not cached)", field=field)
    if len(ips) > MAX_FQDN_IPS:
        raise InvalidArgument(f"{len(ips)} addresses; at most {MAX_FQDN_IPS}", field=field)
    out: dict[str, None] = {}
    for i, text in enumerate(ips):
        try:
            out[str(ipaddress.ip_address(text))] = None
        except ValueError:
            raise InvalidArgument(f"{text!r} is not an IP address", field=f"{field}[{i}]") from None
    return tuple(out)


def check_fqdn_ttl(ttl: int, field: str) -> int:
    if ttl > MAX_FQDN_TTL:
        raise InvalidArgument(f"{ttl} s; at most {MAX_FQDN_TTL}", field=field)
    return ttl
