"""toFQDNs (CiliumNetworkPolicy egress): names and patterns as Cilium
matches them, validation naming the field, and resolution: the addresses the
FQDN cache holds for matching names get CIDR identities labelled
fqdn:<selector>, which the rule's subject may reach on its ports, and which
go when the cache entries go."""

from __future__ import annotations

import pytest
from policy_world import World

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.common.fqdn import matcher
from flagella.policy.convert import rule_from_pb, rule_pb
from flagella.policy.labels import Label
from flagella.policy.rules import Protocol, parse_document, rule_from_json, rule_to_json
from flagella.policy.rules.fqdn import check_name, check_pattern

TCP = Protocol.TCP

DOC = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-api, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toFQDNs: [{matchName: API.Example.Test.}, {matchPattern: "*.cdn.test"}]
    toPorts: [{ports: [{port: "443", protocol: TCP}]}]
"""


@pytest.mark.parametrize(
    ("key", "name", "expected"),
    [
        ("api.example.test", "api.example.test", True),
        ("api.example.test", "www.api.example.test", False),
        ("*.example.test", "a.example.test", True),
        ("*.example.test", "a-b_c.example.test", True),
        # One label only, and never the bare domain (Cilium's matchpattern).
        ("*.example.test", "a.b.example.test", False),
        ("*.example.test", "example.test", False),
        ("*", "anything.at.all", True),
        ("api*.test", "api.test", True),
        ("api*.test", "api-2.test", True),
        ("api*.test", "x.api.test", False),
    ],
)
def test_patterns_match_as_cilium(key: str, name: str, expected: bool) -> None:
    assert matcher(key)(name) is expected


def test_names_and_patterns_are_canonical_and_checked() -> None:
    assert check_name("API.Example.Test.", "f") == "api.example.test"
    assert check_pattern("*.Example.TEST", "f") == "*.example.test"
    for bad, why in [
        ("", "required"),
        ("a..b", "not a DNS name"),
        ("a b.test", "not a DNS name"),
        ("x" * 64 + ".test", "not a DNS name"),
        ("a.*.test", "not a DNS name"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            check_name(bad, "spec.egress[0].toFQDNs[0].matchName")
        assert err.value.field == "spec.egress[0].toFQDNs[0].matchName"
        assert why in str(err.value)
    with pytest.raises(InvalidArgument, match="not a name pattern"):
        check_pattern("*.exa mple.test", "p")


def test_documents_and_protos_carry_fqdns_and_refuse_them_elsewhere() -> None:
    (rule,) = parse_document(DOC)
    assert [f.key for f in rule.egress[0].fqdns] == ["api.example.test", "*.cdn.test"]
    assert rule_from_json(rule_to_json(rule)).content() == rule.content()
    assert rule_from_pb(rule_pb(rule), "rule").content() == rule.content()

    cases = [
        (
            DOC.replace("matchName: API.Example.Test.", "matchName: a_b c"),
            "spec.egress[0].toFQDNs[0].matchName",
        ),
        (
            DOC.replace("{matchName: API.Example.Test.}", "{matchName: a.test, matchPattern: b}"),
            "spec.egress[0].toFQDNs[0]",
        ),
        (DOC.replace("egress:", "egressDeny:"), "spec.egressDeny[0].toFQDNs"),
        (DOC.replace("egress:", "ingress:"), "spec.ingress[0].toFQDNs"),
    ]
    for text, field in cases:
        with pytest.raises(InvalidArgument) as err:
            parse_document(text)
        assert err.value.field == field, (field, err.value)

    deny = rule_pb(rule)
    deny.egress_deny.append(deny.egress[0])
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(deny, "rules[0]")
    assert err.value.field == "rules[0].egress_deny[0].fqdns"
    bad = rule_pb(rule)
    bad.egress[0].fqdns.add(match_pattern="*.ok.test", match_name="x.test")
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(bad, "rules[0]")
    assert err.value.field == "rules[0].egress[0].fqdns[2]"
    empty = rule_pb(rule)
    empty.egress[0].fqdns.append(pb.FQDNSelector())
    with pytest.raises(InvalidArgument, match="exactly one"):
        rule_from_pb(empty, "rules[0]")


def test_learned_addresses_are_reachable_on_the_rule_ports_only() -> None:
    w = World()
    web = w.pod("web", "shop", app="web")
    w.rules(DOC)
    # Nothing learned yet: the egress is enforced and allows nothing.
    assert not w.allowed(web, w.names["world"], 443, TCP)
    assert w.state.fqdn_selections() == {"api.example.test": {}, "*.cdn.test": {}}

    w.fqdn("node-a", "12", "api.example.test", "192.0.2.10", "2001:db8::10")
    w.fqdn("node-b", "40", "img.cdn.test", "198.51.100.7")
    w.fqdn("node-b", "40", "other.test", "203.0.113.9")
    api4, api6, cdn = w.cidr("192.0.2.10"), w.cidr("2001:db8::10"), w.cidr("198.51.100.7")
    assert w.state.ipcache_entry("192.0.2.10").source == "fqdn"  # type: ignore[union-attr]
    labels = w.state.info(api4).labels  # type: ignore[union-attr]
    assert Label(key="api.example.test", source="fqdn") in labels
    assert Label(key="192.0.2.10/32", source="cidr") in labels
    for peer in (api4, api6, cdn):
        assert w.allowed(web, peer, 443, TCP)
        assert not w.allowed(web, peer, 80, TCP)
    # A name no selector matches gets no identity: it is world, denied.
    assert w.state.ipcache_entry("203.0.113.9") is None
    assert not w.allowed(web, w.names["world"], 443, TCP)

    # Another endpoint's entry holds the address too: one entry going
    # leaves it; the last one going takes its identity and the allow.
    w.fqdn("node-b", "41", "api.example.test", "192.0.2.10")
    w.fqdn("node-a", "12", "api.example.test")
    assert w.cidr("192.0.2.10") == api4
    assert w.state.ipcache_entry("2001:db8::10") is None
    w.fqdn("node-b", "41", "api.example.test")
    assert w.state.ipcache_entry("192.0.2.10") is None
    assert api4 not in w.state.resolver.identities
    assert w.allowed(web, cdn, 443, TCP)

    # The rule going takes every fqdn identity with it.
    w.delete_rule("shop/to-api")
    assert w.state.ipcache_entry("198.51.100.7") is None


def test_an_address_also_named_by_a_cidr_rule_keeps_one_identity_with_both_labels() -> None:
    w = World()
    web = w.pod("web", "shop", app="web")
    w.rules(DOC)
    w.rules(
        DOC.replace("to-api", "to-net")
        .replace(
            'toFQDNs: [{matchName: API.Example.Test.}, {matchPattern: "*.cdn.test"}]',
            "toCIDR: [192.0.2.10/32]",
        )
        .replace('"443"', '"22"')
    )
    cidr_only = w.cidr("192.0.2.10")
    assert w.state.ipcache_entry("192.0.2.10").source == "cidr-policy"  # type: ignore[union-attr]
    w.fqdn("node-a", "12", "api.example.test", "192.0.2.10")
    assert w.cidr("192.0.2.10") == cidr_only
    assert w.allowed(web, cidr_only, 443, TCP)
    assert w.allowed(web, cidr_only, 22, TCP)
    w.fqdn("node-a", "12", "api.example.test")
    assert w.cidr("192.0.2.10") == cidr_only
    assert not w.allowed(web, cidr_only, 443, TCP)
    assert w.allowed(web, cidr_only, 22, TCP)


def test_selectors_in_use_name_what_they_select_and_their_rules() -> None:
    w = World()
    web = w.pod("web", "shop", app="web")
    w.rules(DOC)
    w.fqdn("node-a", "12", "api.example.test", "192.0.2.10")
    uses = {(u.selector, u.role): u for u in w.state.resolver.selectors_in_use()}
    subject = uses[("{k8s:app=web, k8s:io.kubernetes.pod.namespace=shop}", "subject")]
    assert subject.identities == (web,)
    assert subject.rules == ("shop/to-api",)
    api = uses[("{fqdn:api.example.test}", "peer")]
    assert api.identities == (w.cidr("192.0.2.10"),)
    assert uses[("{fqdn:*.cdn.test}", "peer")].identities == ()
    w.delete_rule("shop/to-api")
    assert w.state.resolver.selectors_in_use() == []


DNS_DOC = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: dns, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEndpoints: [{matchLabels: {app: kube-dns}}]
    toPorts:
    - ports: [{port: "53", protocol: UDP}, {port: "53", protocol: TCP}]
      rules:
        dns: [{matchName: API.example.test.}, {matchPattern: "*.cdn.test"}]
"""


def test_dns_rules_reach_the_resolved_policy_and_are_refused_elsewhere() -> None:
    (rule,) = parse_document(DNS_DOC)
    assert [f.key for f in rule.egress[0].dns] == ["api.example.test", "*.cdn.test"]
    assert rule_from_json(rule_to_json(rule)).content() == rule.content()
    assert rule_from_pb(rule_pb(rule), "rule").content() == rule.content()
    w = World()
    web = w.pod("web", "shop", app="web")
    other = w.pod("other", "shop", app="other")
    w.rules(DNS_DOC)
    content = w.content(web)
    assert content.dns_proxy
    assert content.dns_rules == ("*.cdn.test", "api.example.test")
    assert not w.content(other).dns_proxy
    # toFQDNs alone: through the proxy, every name may be looked up.
    w.rules(DOC)
    assert w.content(web).dns_rules == ("*.cdn.test", "api.example.test")

    cases = [
        (DNS_DOC.replace('port: "53", protocol: UDP}, {port: "53"', 'port: "54", protocol: UDP}, {port: "54"'),
         "spec.egress[0].toPorts[0].rules"),
        (DNS_DOC.replace("egress:", "ingress:").replace("toEndpoints", "fromEndpoints"),
         "spec.ingress[0].toPorts[0].rules"),
        (DNS_DOC.replace("egress:", "egressDeny:"), "spec.egressDeny[0].toPorts[0].rules"),
        (DNS_DOC.replace("        dns: [", "        http: [{}]\n        dns: ["), "spec.egress[0].toPorts[0].rules.http"),
        (DNS_DOC.replace("matchPattern: \"*.cdn.test\"", "matchPattern: \"a b\""),
         "spec.egress[0].toPorts[0].rules.dns[1].matchPattern"),
    ]  # fmt: skip
    for text, field in cases:
        with pytest.raises(InvalidArgument) as err:
            parse_document(text)
        assert err.value.field == field, (field, err.value)
    bad = rule_pb(rule)
    bad.egress[0].to_ports[0].ports[0].port = 80
    bad.egress[0].to_ports[0].ports[1].port = 80
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(bad, "rules[0]")
    assert err.value.field == "rules[0].egress[0].dns"
    bad = rule_pb(rule)
    bad.ingress.append(bad.egress[0])
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(bad, "rules[0]")
    assert err.value.field == "rules[0].ingress[0].dns"
