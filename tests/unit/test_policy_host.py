"""Host policies (nodeSelector rules, as Cilium's): parsing and its errors,
the etcd JSON and proto round trips, selection of a node's host endpoint by
its labels, and resolution (peers as for pods; host rules never select
pods)."""

from __future__ import annotations

import pytest
from policy_world import World, lookup

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.policy.convert import rule_from_pb, rule_pb
from flagella.policy.hostpolicy import host_info
from flagella.policy.labels import LabelError
from flagella.policy.rules import (
    Direction,
    Protocol,
    parse_document,
    rule_from_json,
    rule_to_json,
)


def ccnp(name: str, spec: str) -> str:
    return (
        "---\napiVersion: cilium.io/v2\nkind: CiliumClusterwideNetworkPolicy\n"
        f"metadata: {{name: {name}}}\nspec:\n{spec}"
    )


SSH_FROM_ADMINS = ccnp(
    "ssh-from-admins",
    """  nodeSelector: {matchLabels: {role: edge}}
  ingress:
  - fromCIDR: [198.51.100.0/24]
    toPorts: [{ports: [{port: "2222", protocol: TCP}]}]
  - fromEndpoints: [{matchLabels: {app: monitor}}]
    toPorts: [{ports: [{port: "9100", protocol: TCP}]}]
""",
)


def test_a_node_selector_rule_parses_as_a_host_policy() -> None:
    (rule,) = parse_document(SSH_FROM_ADMINS)
    assert rule.host
    assert rule.namespace == ""
    assert rule.node_selector is not None
    assert rule.node_selector.match_labels == (("role", "edge"),)
    again = rule_from_json(rule_to_json(rule))
    assert again == rule
    assert rule_from_pb(rule_pb(rule), "rule") == rule.content()


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (
            ccnp(
                "both",
                "  nodeSelector: {}\n  endpointSelector: {}\n  ingress: [{}]\n",
            ),
            "spec.nodeSelector",
        ),
        (ccnp("neither", "  ingress: [{}]\n"), "spec.endpointSelector"),
        (
            "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\n"
            "metadata: {name: ns, namespace: shop}\nspec:\n  nodeSelector: {}\n",
            "spec.nodeSelector",
        ),
        (
            "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\n"
            "metadata: {name: ns, namespace: shop}\nspec:\n  nodeSelector: {}\n",
            "spec.nodeSelector",
        ),
    ],
)
def test_node_selector_errors_name_the_field(doc: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_document(doc)
    assert err.value.field == field, err.value


def test_proto_node_selector_errors_name_the_field() -> None:
    sel = pb.EndpointSelector(match_labels={"role": "edge"})
    both = pb.Rule(name="x", endpoint_selector=sel, node_selector=sel)
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(both, "rules.rules[0]")
    assert err.value.field == "rules.rules[0].node_selector"
    namespaced = pb.Rule(name="x", namespace="shop", node_selector=sel)
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(namespaced, "rules.rules[0]")
    assert err.value.field == "rules.rules[0].node_selector"
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(pb.Rule(name="x"), "rules.rules[0]")
    assert err.value.field == "rules.rules[0].endpoint_selector"


def world() -> World:
    w = World()
    w.pod("monitor", "ops", app="monitor")
    w.pod("web", "shop", app="web")
    w.rules(SSH_FROM_ADMINS)
    return w


def test_host_rules_select_nodes_by_their_labels_not_pods() -> None:
    w = world()
    resolver = w.state.resolver
    assert resolver.host_content(host_info({"role": "edge", "zone": "a"})) is not None
    assert resolver.host_content(host_info({"role": "core"})) is None
    assert resolver.host_content(host_info({})) is None
    # The rule selects no pod, not even one labelled like the node.
    edge_pod = w.pod("edge-pod", "shop", role="edge")
    assert not w.content(edge_pod).ingress_enforced
    assert not w.content(w.names["web"]).ingress_enforced
    # reserved:host is the host endpoint's own label.
    w.rules(
        ccnp("every-host", "  nodeSelector: {matchLabels: {reserved:host: ''}}\n  ingress: [{}]\n")
    )
    assert resolver.host_content(host_info({})) is not None


def test_host_policy_resolves_peers_as_for_pods() -> None:
    w = world()
    found = w.state.resolver.host_content(host_info({"role": "edge"}))
    assert found is not None
    content, rules = found
    assert rules == {"ssh-from-admins"}
    assert content.ingress_enforced
    assert not content.egress_enforced
    monitor = w.names["monitor"]
    admins = w.cidr("198.51.100.0/24")
    assert lookup(content, admins, 2222, Protocol.TCP, Direction.INGRESS)
    assert not lookup(content, admins, 22, Protocol.TCP, Direction.INGRESS)
    assert not lookup(content, w.names["world"], 2222, Protocol.TCP, Direction.INGRESS)
    assert lookup(content, monitor, 9100, Protocol.TCP, Direction.INGRESS)
    assert not lookup(content, w.names["web"], 9100, Protocol.TCP, Direction.INGRESS)
    assert lookup(content, w.names["web"], 80, Protocol.TCP, Direction.EGRESS)
    # A new pod matching a peer selector is in the next resolution.
    monitor2 = w.pod("monitor-2", "ops", app="monitor")
    found = w.state.resolver.host_content(host_info({"role": "edge"}))
    assert found is not None
    assert lookup(found[0], monitor2, 9100, Protocol.TCP, Direction.INGRESS)
    # Removing the rule removes the host policy.
    w.delete_rule("ssh-from-admins")
    assert w.state.resolver.host_content(host_info({"role": "edge"})) is None


def test_host_deny_and_egress_clauses() -> None:
    w = world()
    w.rules(
        ccnp(
            "edge-egress",
            """  nodeSelector: {matchLabels: {role: edge}}
  egress:
  - toEntities: [cluster]
  egressDeny:
  - toEndpoints: [{matchLabels: {app: web}}]
""",
        )
    )
    found = w.state.resolver.host_content(host_info({"role": "edge"}))
    assert found is not None
    content, rules = found
    assert rules == {"ssh-from-admins", "edge-egress"}
    assert content.egress_enforced
    assert lookup(content, w.names["monitor"], 443, Protocol.TCP, Direction.EGRESS)
    assert not lookup(content, w.names["web"], 443, Protocol.TCP, Direction.EGRESS)
    assert not lookup(content, w.names["world"], 443, Protocol.TCP, Direction.EGRESS)


def test_host_labels_are_the_nodes_labels_and_reserved_host() -> None:
    info = host_info({"role": "edge", "topology.kubernetes.io/zone": "a"})
    assert {str(label) for label in info.labels} == {
        "reserved:host",
        "k8s:role=edge",
        "k8s:topology.kubernetes.io/zone=a",
    }
    with pytest.raises(LabelError):
        host_info({"bad key": "x"})


def test_a_change_says_whether_it_may_touch_a_host_policy() -> None:
    """Host policy streams wake only on Change.host: a host rule, or a peer
    a host rule selects; not a pod rule, nor an identity no host rule names."""
    w = world()
    assert w.last_change.host  # the host rule came
    w.pod("db", "shop", app="db")
    assert not w.last_change.host
    w.pod("monitor-2", "ops", app="monitor")
    assert w.last_change.host  # a peer of the host rule
    w.rules(
        """---
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress: [{fromEndpoints: [{matchLabels: {app: db}}]}]
"""
    )
    assert not w.last_change.host
    w.reference(w.names["web"], "n1")
    assert not w.last_change.host
    w.delete_rule("ssh-from-admins")
    assert w.last_change.host
    w.pod("monitor-3", "ops", app="monitor")
    assert not w.last_change.host  # no host rule selects it any more
