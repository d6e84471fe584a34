"""Labels, the identity label filter, key encoding and CIDR identities."""

from __future__ import annotations

import ipaddress

import pytest

from flagella.policy import keys
from flagella.policy.identities import (
    LOCAL_SCOPE,
    assign_cidr_identities,
    format_prefix,
    parse_prefix,
    reserved_identity_of,
)
from flagella.policy.labels import (
    Label,
    LabelError,
    LabelFilter,
    format_labels,
    label_set,
    labels_from_string,
    parse_labels,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("app=web", Label("app", "k8s", "web")),
        ("k8s:app=web", Label("app", "k8s", "web")),
        ("reserved:host", Label("host", "reserved", "")),
        ("container:io.x/y=z", Label("io.x/y", "container", "z")),
        ("cidr:f00d::/64", Label("f00d::/64", "cidr", "")),
        ("app.kubernetes.io/name=shop", Label("app.kubernetes.io/name", "k8s", "shop")),
    ],
)
def test_parse_label(text: str, expected: Label) -> None:
    assert Label.parse(text) == expected


@pytest.mark.parametrize("text", ["=x", "any:app=x", "k8s:app=a b", "k8s:a;b=c", "k8s:app=x;y"])
def test_bad_labels(text: str) -> None:
    with pytest.raises(LabelError):
        Label.parse(text)


def test_label_set_is_sorted_and_rejects_conflicts() -> None:
    ls = parse_labels(["k8s:b=2", "k8s:a=1", "k8s:a=1"])
    assert format_labels(ls) == "k8s:a=1;k8s:b=2;"
    assert labels_from_string(format_labels(ls)) == ls
    with pytest.raises(LabelError):
        label_set([Label("a", "k8s", "1"), Label("a", "k8s", "2")])


def test_default_label_filter() -> None:
    f = LabelFilter()
    keep = [
        "k8s:app=web",
        "k8s:io.kubernetes.pod.namespace=shop",
        "k8s:io.cilium.k8s.namespace.labels.team=a",
        "k8s:app.kubernetes.io/name=shop",
        "reserved:host",
        "k8s:io.cilium.k8s.policy.serviceaccount=default",
    ]
    drop = [
        "k8s:pod-template-hash=abc",
        "k8s:controller-revision-hash=1",
        "k8s:pod-template-generation=2",
        "k8s:io.kubernetes.pod.name=web-1",
        "k8s:statefulset.kubernetes.io/pod-name=web-0",
        "k8s:annotation.foo=bar",
        "k8s:beta.kubernetes.io/arch=amd64",
    ]
    ls = parse_labels(keep + drop)
    assert {str(lb) for lb in f.filter(ls)} == {str(Label.parse(t)) for t in keep}


def test_custom_label_filter_first_match_wins() -> None:
    f = LabelFilter(["!app$", "app"])
    ls = parse_labels(["app=x", "appname=y", "other=z"])
    assert [str(lb) for lb in f.filter(ls)] == ["k8s:appname=y", "k8s:other=z"]
    with pytest.raises(ValueError, match="invalid label filter"):
        LabelFilter(["("])


def test_reserved_identities() -> None:
    assert reserved_identity_of(parse_labels(["reserved:host"])) == 1
    assert reserved_identity_of(parse_labels(["reserved:world"])) == 2
    assert reserved_identity_of(parse_labels(["reserved:init"])) == 5
    assert reserved_identity_of(parse_labels(["reserved:remote-node"])) == 6
    assert reserved_identity_of(parse_labels(["reserved:host", "k8s:a=b"])) is None


def test_key_encoding_round_trips() -> None:
    labels = "k8s:app.kubernetes.io/name=a%b;k8s:x=y;"
    key = keys.ref_key(labels, "node-1")
    assert key.count("/") == keys.VALUE_PREFIX.count("/") + 1
    parsed = keys.parse_key(key)
    assert (parsed.kind, parsed.a, parsed.b) == ("ref", labels, "node-1")
    assert keys.parse_key(keys.labels_key(labels)).a == labels
    assert keys.parse_key(keys.ip_key("10.0.0.0/8")).a == "10.0.0.0/8"
    assert keys.parse_key(keys.rule_key("ns/name")).a == "ns/name"
    assert keys.parse_key("flagella/state/other/x").kind == ""


def test_cidr_identities_are_deterministic_and_distinct() -> None:
    nets = [ipaddress.ip_network(f"10.{i // 256}.{i % 256}.0/24") for i in range(2000)]
    a = assign_cidr_identities(nets)
    b = assign_cidr_identities(list(reversed(nets)))
    assert a == b
    assert len(set(a.values())) == len(nets)
    assert all(LOCAL_SCOPE < v < 2 * LOCAL_SCOPE for v in a.values())


def test_cidr_identity_collisions_keep_the_older_prefix() -> None:
    nets = [ipaddress.ip_network(f"10.{i // 256}.{i % 256}.0/24") for i in range(60000)]
    found = None
    slots: dict[int, ipaddress.IPv4Network | ipaddress.IPv6Network] = {}
    for net in nets:
        single = assign_cidr_identities([net])[net]
        if single in slots:
            found = (slots[single], net)
            break
        slots[single] = net
    assert found is not None, "expected a hash collision among 60000 prefixes"
    old, new = found
    first = assign_cidr_identities({old: (1,), new: (2,)})
    second = assign_cidr_identities({old: (2,), new: (1,)})
    assert first[old] == second[new]  # the older one keeps the slot
    assert first[old] != first[new]


def test_prefix_format() -> None:
    assert format_prefix(parse_prefix("10.0.0.1")) == "10.0.0.1"
    assert format_prefix(parse_prefix("10.0.0.1/32")) == "10.0.0.1"
    assert format_prefix(parse_prefix("fd00::/64")) == "fd00::/64"
    with pytest.raises(ValueError, match="host bits set"):
        parse_prefix("10.0.0.1/8")
