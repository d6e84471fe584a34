"""CIDR groups (as CiliumCIDRGroup) as the API and the Kubernetes watcher
give them: checked field by field into a CIDRGroup."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flagella.policy.labels import LabelError, check_key
from flagella.policy.rules.model import BY_HAND, CIDRGroup, RuleSource
from flagella.policy.rules.validate import (
    MAX_GROUP_CIDRS,
    check_label_value,
    check_name,
    fail,
    parse_network,
)


@dataclass(frozen=True, slots=True)
class GroupFields:
    """Where each part of a group is in the caller's request (for errors)."""

    name: str = "name"
    cidrs: str = "cidrs"
    labels: str = "labels"


API_FIELDS = GroupFields()
K8S_FIELDS = GroupFields("metadata.name", "spec.externalCIDRs", "metadata.labels")


def make_cidr_group(
    name: str,
    cidrs: Sequence[str],
    labels: Mapping[str, str],
    *,
    fields: GroupFields = API_FIELDS,
    source: RuleSource = BY_HAND,
) -> CIDRGroup:
    """Raises InvalidArgument naming the field. A CIDR with host bits set is
    refused rather than masked: neither answer carries warnings."""
    check_name(name, fields.name)
    if len(cidrs) > MAX_GROUP_CIDRS:
        raise fail(fields.cidrs, f"{len(cidrs)} CIDRs; at most {MAX_GROUP_CIDRS}")
    out = []
    for i, text in enumerate(cidrs):
        path = f"{fields.cidrs}[{i}]"
        net = parse_network(text, path)
        if "/" in text and ipaddress.ip_interface(text).ip != net.network_address:
            raise fail(path, f"{text} has host bits set (mean {net}?)")
        out.append(str(net))
    items = sorted(labels.items())
    for key, value in items:
        try:
            check_key(key)
        except LabelError as exc:
            raise fail(f"{fields.labels}[{key}]", str(exc)) from None
        check_label_value(value, f"{fields.labels}[{key}]")
    return CIDRGroup(name, tuple(dict.fromkeys(out)), tuple(items), source=source)
