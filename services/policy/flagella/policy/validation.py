"""Checks of request fields: what the servicer validates before it calls
the service, which trusts its typed inputs."""

from __future__ import annotations

from collections.abc import Iterable

from flagella.common.errors import InvalidArgument
from flagella.policy import keys
from flagella.policy.identities import (
    RESERVED_NAMES,
    format_prefix,
    parse_prefix,
    reserved_identity_of,
)
from flagella.policy.labels import SOURCE_RESERVED, Label, LabelFilter, LabelSet, label_set


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
