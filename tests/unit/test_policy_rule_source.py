"""A rule's source (the Kubernetes object it came from, or none: by hand):
its name, its JSON in etcd (rules stored before sources existed read back
as rules by hand), and the translation of objects as the API gives them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flagella.common.errors import InvalidArgument
from flagella.policy.kube import KINDS, translate
from flagella.policy.rules import Rule, RuleSource, parse_document, rule_from_json, rule_to_json

NP = {
    "metadata": {"name": "web", "namespace": "shop", "uid": "u-1", "resourceVersion": "7"},
    "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{}]},
}
KIND = {k.kind: k for k in KINDS}


def test_rules_by_hand_and_from_kubernetes_have_distinct_names() -> None:
    by_hand = Rule(name="web", namespace="shop")
    np = Rule(name="web", namespace="shop", source=RuleSource("NetworkPolicy", "shop", "web"))
    ccnp = Rule(name="web", source=RuleSource("CiliumClusterwideNetworkPolicy", "", "web"))
    assert (by_hand.key, np.key, ccnp.key) == (
        "shop/web",
        "NetworkPolicy/shop/web",
        "CiliumClusterwideNetworkPolicy/web",
    )
    assert by_hand.content() != np.content()
    assert KIND["NetworkPolicy"].rule_name("shop/web") == np.key
    assert KIND["CiliumClusterwideNetworkPolicy"].rule_name("/web") == ccnp.key


def test_the_source_is_stored_and_older_rules_read_back_by_hand() -> None:
    rule = Rule(name="web", namespace="shop", source=RuleSource("NetworkPolicy", "shop", "web"))
    assert rule_from_json(rule_to_json(rule)) == rule
    old = json.loads(rule_to_json(Rule(name="web", namespace="shop")))
    assert "source" not in old
    assert rule_from_json(json.dumps(old).encode()).source == RuleSource()


def test_an_object_as_the_api_gives_it_translates_as_import_does() -> None:
    # A list's items carry no apiVersion and kind: the collection's are used.
    rule = translate(KIND["NetworkPolicy"], NP)
    imported = parse_document(
        json.dumps({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", **NP})
    )
    assert rule.source == RuleSource("NetworkPolicy", "shop", "web")
    assert rule == dataclasses.replace(imported[0], source=rule.source)


def test_an_invalid_object_names_the_field() -> None:
    bad = {**NP, "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 99999}]}]}}
    with pytest.raises(InvalidArgument) as err:
        translate(KIND["NetworkPolicy"], bad)
    assert err.value.field == "spec.ingress[0].ports[0].port"
