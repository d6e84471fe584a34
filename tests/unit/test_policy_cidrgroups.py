"""CIDR groups (CiliumCIDRGroup) named by rules (`cidrGroupRef`): the rule
follows the group's CIDRs as they are edited, exceptions apply to the
group CIDRs they lie in, a missing or empty group selects nothing (never
any peer), and every error names its field."""

from __future__ import annotations

import pytest
from policy_world import World

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.policy.convert import cidr_group_from_pb, rule_from_pb, rule_pb
from flagella.policy.identities import WORLD
from flagella.policy.rules import CIDRSpec, Protocol, parse_document, rule_from_json, rule_to_json

TCP = Protocol.TCP

EGRESS_TO_GROUP = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: partners, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toCIDRSet: [{cidrGroupRef: partners, except: [192.0.2.128/25]}]
    toPorts: [{ports: [{port: "443", protocol: TCP}]}]
"""


# Gives the outside prefixes the traffic goes to their CIDR identities,
# whatever the groups hold (a rule selecting no pod).
TARGETS = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: targets, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: nobody}}
  egress:
  - toCIDR: [192.0.2.0/24, 192.0.2.128/25, 198.51.100.7/32]
"""


def world() -> World:
    w = World()
    w.pod("web", "default", app="web")
    w.rules(TARGETS)
    return w


def to(w: World, prefix: str, port: int = 443) -> bool:
    return w.allowed(w.names["web"], w.cidr(prefix), port, TCP)


def test_a_rule_follows_its_group_as_it_is_edited() -> None:
    w = world()
    w.cidr_group("partners", "192.0.2.0/24")
    w.rules(EGRESS_TO_GROUP)
    assert to(w, "192.0.2.0/24")
    assert not to(w, "192.0.2.128/25")  # the except, inside the group's CIDR
    assert not to(w, "198.51.100.7")
    assert not to(w, "192.0.2.0/24", 80)
    # Edited in place: the new CIDRs, not the old ones.
    w.cidr_group("partners", "198.51.100.0/24")
    assert to(w, "198.51.100.7")
    assert not to(w, "192.0.2.0/24")
    # Deleted: the rule selects nothing through it.
    w.delete_cidr_group("partners")
    assert not to(w, "198.51.100.7")


def test_a_missing_or_empty_group_never_means_any_peer() -> None:
    w = world()
    w.rules(EGRESS_TO_GROUP)  # no group "partners" yet
    web = w.names["web"]
    assert not w.allowed(web, WORLD, 443, TCP)
    assert not to(w, "192.0.2.0/24")
    w.cidr_group("partners")  # empty
    assert not w.allowed(web, WORLD, 443, TCP)
    # Created later: takes effect.
    w.cidr_group("partners", "192.0.2.0/24")
    assert to(w, "192.0.2.0/24")


def test_document_fields_and_errors() -> None:
    (rule,) = parse_document(EGRESS_TO_GROUP)
    assert rule.egress[0].cidrs == (CIDRSpec("", ("192.0.2.128/25",), "partners"),)
    assert rule_from_json(rule_to_json(rule)) == rule
    cases = {
        "{cidrGroupRef: partners, cidr: 10.0.0.0/8}": ("toCIDRSet[0].cidr", "exactly one"),
        "{except: [10.0.0.0/8]}": ("toCIDRSet[0].cidr", "exactly one"),
        "{cidrGroupRef: Partners}": ("toCIDRSet[0].cidrGroupRef", "not a valid name"),
        "{cidrGroupRef: partners, except: [nope]}": ("toCIDRSet[0].except[0]", "not a valid CIDR"),
        "{cidrGroupSelector: {}}": ("toCIDRSet[0].cidrGroupSelector", "use cidrGroupRef"),
    }
    for item, (field, message) in cases.items():
        text = EGRESS_TO_GROUP.replace("{cidrGroupRef: partners, except: [192.0.2.128/25]}", item)
        with pytest.raises(InvalidArgument) as err:
            parse_document(text)
        assert err.value.field == f"spec.egress[0].{field}", item
        assert message in str(err.value), item


def test_proto_api_group_reference_and_group_validation() -> None:
    ref = pb.CIDRRule(group="partners")
    rule = rule_from_pb(
        pb.Rule(
            name="default/p",
            endpoint_selector=pb.EndpointSelector(match_labels={"app": "web"}),
            egress=[pb.PeerRule(cidrs=[ref])],
        ),
        "rules.rules[0]",
    )
    assert rule.egress[0].cidrs == (CIDRSpec("", (), "partners"),)
    assert rule_pb(rule).egress[0].cidrs[0].group == "partners"
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(
            pb.Rule(
                name="default/p",
                endpoint_selector=pb.EndpointSelector(),
                egress=[pb.PeerRule(cidrs=[pb.CIDRRule(cidr="10.0.0.0/8", group="partners")])],
            ),
            "rules.rules[0]",
        )
    assert err.value.field == "rules.rules[0].egress[0].cidrs[0].group"

    group = cidr_group_from_pb(pb.CIDRGroup(name="partners", cidrs=["192.0.2.1", "2001:db8::/32"]))
    assert group.cidrs == ("192.0.2.1/32", "2001:db8::/32")
    for bad, field in [
        (pb.CIDRGroup(name="", cidrs=[]), "name"),
        (pb.CIDRGroup(name="Partners"), "name"),
        (pb.CIDRGroup(name="p", cidrs=["10.0.0.0/8", "10.0.0.1/8"]), "cidrs[1]"),
        (pb.CIDRGroup(name="p", cidrs=["10.0.0.0/8"] * 1001), "cidrs"),
        (pb.CIDRGroup(name="p", labels={"bad key!": "x"}), "labels[bad key!]"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            cidr_group_from_pb(bad)
        assert err.value.field == field, bad


def test_a_cilium_cidr_group_object_is_checked_with_its_own_field_paths() -> None:
    from flagella.policy.kube import KINDS, translate_cidr_group
    from flagella.policy.rules import cidr_group_from_json, cidr_group_to_json

    [kind] = [k for k in KINDS if k.cidr_groups]

    def obj(name: str, cidrs: object) -> dict[str, object]:
        return {"metadata": {"name": name}, "spec": {"externalCIDRs": cidrs}}

    group = translate_cidr_group(kind, obj("partners", ["192.0.2.0/24", "2001:db8::1"]))
    assert group.cidrs == ("192.0.2.0/24", "2001:db8::1/128")
    assert (group.source.kind, group.source.name) == ("CiliumCIDRGroup", "partners")
    # The source is kept in etcd's JSON (what the watcher compares).
    again = cidr_group_from_json("partners", cidr_group_to_json(group))
    assert again.content() == group.content()
    for bad, field in (
        (obj("partners", ["192.0.2.1/24"]), "spec.externalCIDRs[0]"),
        (obj("partners", ["10.0.0.0/8", "nonsense"]), "spec.externalCIDRs[1]"),
        (obj("partners", "192.0.2.0/24"), "spec.externalCIDRs"),
        (obj("Partners", []), "metadata.name"),
    ):
        with pytest.raises(InvalidArgument) as err:
            translate_cidr_group(kind, bad)
        assert err.value.field == field
