"""Parsing and validation of policy documents: FlagellaNetworkPolicy,
Kubernetes NetworkPolicy, Lists; every error names the path into the
document."""

from __future__ import annotations

import pytest

from flagella.common.errors import InvalidArgument
from flagella.policy.rules import (
    CIDRSpec,
    Direction,
    Expression,
    PeerSpec,
    PortSpec,
    Protocol,
    SelectorSpec,
    Verdict,
    compile_rule,
    parse_document,
    rule_from_json,
    rule_to_json,
)
from flagella.policy.selector import WILDCARD, Entity, LabelSelector, Op, Requirement

GOOD = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata:
  name: web
  namespace: shop
  labels: {team: payments}
spec:
  description: web gets HTTP from the frontend
  endpointSelector:
    matchLabels: {app: web}
    matchExpressions: [{key: tier, operator: NotIn, values: [test]}]
  ingress:
  - fromEndpoints: [{matchLabels: {app: frontend}}]
    toPorts: [{ports: [{port: "80", protocol: TCP}, {port: "8000", endPort: 8100}]}]
  - fromCIDR: [192.0.2.0/24]
    fromCIDRSet: [{cidr: 10.0.0.0/8, except: [10.96.0.0/12]}]
    fromEntities: [host, remote-node]
  ingressDeny:
  - fromEntities: [world]
  egress:
  - toEntities: [cluster]
  egressDeny:
  - toCIDR: [169.254.169.254/32]
"""


def test_parse_flagella_policy() -> None:
    (rule,) = parse_document(GOOD)
    assert rule.key == "shop/web"
    assert rule.labels == (("team", "payments"),)
    assert rule.endpoint_selector == SelectorSpec(
        (("app", "web"),), (Expression("tier", "NotIn", ("test",)),)
    )
    assert rule.ingress[0] == PeerSpec(
        endpoints=(SelectorSpec((("app", "frontend"),)),),
        to_ports=((PortSpec(80, 0, Protocol.TCP), PortSpec(8000, 8100, Protocol.ANY)),),
    )
    assert rule.ingress[1].cidrs == (
        CIDRSpec("192.0.2.0/24"),
        CIDRSpec("10.0.0.0/8", ("10.96.0.0/12",)),
    )
    assert rule.ingress[1].entities == (Entity.HOST, Entity.REMOTE_NODE)
    assert rule.egress_deny[0].cidrs == (CIDRSpec("169.254.169.254/32"),)
    # the stored form round-trips
    assert rule_from_json(rule_to_json(rule)) == rule


def test_compile_scopes_selectors_to_the_namespace() -> None:
    (rule,) = parse_document(GOOD)
    compiled = compile_rule(rule)
    ns = Requirement("k8s", "io.kubernetes.pod.namespace", Op.IN, ("shop",))
    assert ns in compiled.subject.requirements
    first = compiled.clauses[0]
    assert first.direction is Direction.INGRESS
    assert first.verdict is Verdict.ALLOW
    assert first.selectors == (
        LabelSelector.of([Requirement("k8s", "app", Op.IN, ("frontend",)), ns]),
    )
    # ANY on a port range: TCP, UDP, SCTP
    assert set(first.ports) == {
        (80, 0, Protocol.TCP),
        (8000, 8100, Protocol.TCP),
        (8000, 8100, Protocol.UDP),
        (8000, 8100, Protocol.SCTP),
    }
    assert compiled.enforces_ingress
    assert compiled.enforces_egress
    assert {str(p) for p in compiled.prefixes} == {
        "192.0.2.0/24",
        "10.0.0.0/8",
        "10.96.0.0/12",
        "169.254.169.254/32",
    }


def test_ports_only_clause_is_any_peer_and_empty_clause_selects_nothing() -> None:
    (rule,) = parse_document(
        """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: x}
spec:
  endpointSelector: {}
  ingress:
  - toPorts: [{ports: [{port: "53", protocol: UDP}]}]
  egress:
  - {}
"""
    )
    compiled = compile_rule(rule)
    assert compiled.clauses[0].selectors == (WILDCARD,)
    assert compiled.clauses[1].selectors == ()
    assert compiled.enforces_egress


def test_kubernetes_translation() -> None:
    (rule,) = parse_document(
        """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db, namespace: shop}
spec:
  podSelector: {}
  policyTypes: [Egress]
  ingress:
  - from: [{podSelector: {}}]
  egress:
  - to:
    - podSelector: {matchLabels: {app: db}}
    - namespaceSelector: {matchLabels: {team: a}}
      podSelector: {matchLabels: {app: x}}
    - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}
    ports: [{port: 5432}, {protocol: UDP, port: 53}]
"""
    )
    assert rule.key == "shop/db"
    assert rule.enforce_egress
    assert not rule.enforce_ingress
    assert rule.ingress == ()  # policyTypes has no Ingress: ignored
    (egress,) = rule.egress
    assert egress.endpoints[0] == SelectorSpec((("app", "db"),))
    assert egress.endpoints[1] == SelectorSpec(
        (("app", "x"), ("io.cilium.k8s.namespace.labels.team", "a")),
        (Expression("io.kubernetes.pod.namespace", "Exists"),),
    )
    assert egress.cidrs == (CIDRSpec("10.0.0.0/8", ("10.1.0.0/16",)),)
    assert egress.to_ports == ((PortSpec(5432, 0, Protocol.TCP), PortSpec(53, 0, Protocol.UDP)),)


def test_kubernetes_defaults() -> None:
    (rule,) = parse_document(
        """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny}
spec:
  podSelector: {matchLabels: {app: web}}
"""
    )
    assert rule.namespace == "default"
    assert rule.enforce_ingress
    assert not rule.enforce_egress
    assert rule.ingress == ()
    assert rule.egress == ()


def test_lists_and_multiple_documents() -> None:
    one = """
apiVersion: v1
kind: List
items:
- apiVersion: flagella.io/v1
  kind: FlagellaNetworkPolicy
  metadata: {name: a}
  spec: {endpointSelector: {}}
- apiVersion: networking.k8s.io/v1
  kind: NetworkPolicy
  metadata: {name: b, namespace: x}
  spec: {podSelector: {}}
"""
    assert [r.key for r in parse_document(one)] == ["a", "x/b"]
    two = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: a}
spec: {endpointSelector: {}}
---
{"apiVersion": "flagella.io/v1", "kind": "FlagellaNetworkPolicy",
 "metadata": {"name": "c"}, "spec": {"endpointSelector": {}}}
"""
    assert [r.key for r in parse_document(two)] == ["a", "c"]


def _doc(spec: str, kind: str = "FlagellaNetworkPolicy", api: str = "flagella.io/v1") -> str:
    return f"apiVersion: {api}\nkind: {kind}\nmetadata: {{name: p, namespace: n}}\nspec:\n{spec}"


def _k8s(spec: str) -> str:
    return _doc(spec, "NetworkPolicy", "networking.k8s.io/v1")


ERRORS = [
    (
        "port-out-of-range",
        _doc(
            """  endpointSelector: {}
  ingress:
  - toPorts: [{ports: [{port: "65536"}]}]
"""
        ),
        "spec.ingress[0].toPorts[0].ports[0].port",
        "out of range",
    ),
    (
        "endPort-below-port",
        _doc(
            """  endpointSelector: {}
  egress:
  - toEntities: [world]
    toPorts: [{ports: [{port: "80", protocol: TCP}]}, {ports: [{port: "90", endPort: 85}]}]
"""
        ),
        "spec.egress[0].toPorts[1].ports[0].endPort",
        "below port 90",
    ),
    (
        "bad-protocol",
        _doc(
            """  endpointSelector: {}
  ingress:
  - toPorts: [{ports: [{port: "80", protocol: HTTP}]}]
"""
        ),
        "spec.ingress[0].toPorts[0].ports[0].protocol",
        "unknown protocol",
    ),
    (
        "named-port",
        _doc(
            """  endpointSelector: {}
  ingress:
  - toPorts: [{ports: [{port: Http}]}]
"""
        ),
        "spec.ingress[0].toPorts[0].ports[0].port",
        "named port",
    ),
    (
        "unknown-entity",
        _doc(
            """  endpointSelector: {}
  egress:
  - toEntities: [world, kube-apiserverz]
"""
        ),
        "spec.egress[0].toEntities[1]",
        "unknown entity",
    ),
    (
        "bad-cidr",
        _doc(
            """  endpointSelector: {}
  ingress:
  - fromCIDR: [10.0.0.0/33]
"""
        ),
        "spec.ingress[0].fromCIDR[0]",
        "not a valid CIDR",
    ),
    (
        "except-outside-cidr",
        _doc(
            """  endpointSelector: {}
  egressDeny:
  - toCIDRSet: [{cidr: 10.0.0.0/8, except: [11.0.0.0/16]}]
"""
        ),
        "spec.egressDeny[0].toCIDRSet[0].except[0]",
        "not inside",
    ),
    (
        "unknown-operator",
        _doc(
            """  endpointSelector:
    matchExpressions: [{key: app, operator: Near, values: [x]}]
"""
        ),
        "spec.endpointSelector.matchExpressions[0].operator",
        "unknown operator",
    ),
    (
        "In-without-values",
        _doc(
            """  endpointSelector: {}
  ingress:
  - fromEndpoints: [{matchExpressions: [{key: app, operator: In}]}]
"""
        ),
        "spec.ingress[0].fromEndpoints[0].matchExpressions[0].values",
        "at least one value",
    ),
    (
        "Exists-with-values",
        _doc(
            """  endpointSelector:
    matchExpressions: [{key: app, operator: Exists, values: [x]}]
"""
        ),
        "spec.endpointSelector.matchExpressions[0].values",
        "takes no values",
    ),
    (
        "bad-selector-key",
        _doc(
            """  endpointSelector:
    matchLabels: {"app name": x}
"""
        ),
        "spec.endpointSelector.matchLabels[app name]",
        "invalid label key",
    ),
    (
        "missing-endpointSelector",
        _doc("  ingress: []\n"),
        "spec.endpointSelector",
        "required",
    ),
    (
        "unknown-field",
        _doc(
            """  endpointSelector: {}
  egress:
  - toGroups: [{aws: {securityGroupsIds: [sg-1]}}]
"""
        ),
        "spec.egress[0].toGroups",
        "groups are not supported",
    ),
    (
        "l7-rules",
        _doc(
            """  endpointSelector: {}
  ingress:
  - toPorts: [{ports: [{port: "80"}], rules: {http: [{method: GET}]}}]
"""
        ),
        "spec.ingress[0].toPorts[0].rules",
        "L7 rules are not supported",
    ),
    (
        "wrong-type",
        _doc("  endpointSelector: {}\n  ingress: {fromEntities: [world]}\n"),
        "spec.ingress",
        "expected a list",
    ),
    (
        "neither-kind",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {}\n",
        "kind",
        "neither a FlagellaNetworkPolicy",
    ),
    (
        "missing-name",
        "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\nmetadata: {}\n"
        "spec: {endpointSelector: {}}\n",
        "metadata.name",
        "required",
    ),
    (
        "bad-name",
        "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\nmetadata: {name: Bad_Name}\n"
        "spec: {endpointSelector: {}}\n",
        "metadata.name",
        "not a valid name",
    ),
    ("not-yaml", "spec: [unclosed", "document", "not valid YAML"),
    (
        "duplicate-key",
        "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\nmetadata: {name: a}\n"
        "spec: {endpointSelector: {}}\napiVersion: flagella.io/v1\n",
        "document",
        "line 5 column 1: duplicate key 'apiVersion'",
    ),
    ("empty", "", "document", "no policy"),
    (
        "k8s-ipblock-cidr",
        _k8s(
            """  podSelector: {}
  ingress:
  - from: [{ipBlock: {cidr: 300.0.0.0/8}}]
"""
        ),
        "spec.ingress[0].from[0].ipBlock.cidr",
        "not a valid CIDR",
    ),
    (
        "k8s-policyType",
        _k8s("  podSelector: {}\n  policyTypes: [Ingress, Sideways]\n"),
        "spec.policyTypes[1]",
        "unknown policy type",
    ),
    (
        "k8s-port",
        _k8s(
            """  podSelector: {}
  egress:
  - ports: [{port: 0, endPort: 10}]
"""
        ),
        "spec.egress[0].ports[0].endPort",
        "needs a start port",
    ),
    (
        "k8s-ipblock-with-selector",
        _k8s(
            """  podSelector: {}
  ingress:
  - from: [{ipBlock: {cidr: 10.0.0.0/8}, podSelector: {}}]
"""
        ),
        "spec.ingress[0].from[0].ipBlock",
        "cannot be combined",
    ),
    (
        "k8s-missing-podSelector",
        _k8s("  policyTypes: [Ingress]\n"),
        "spec.podSelector",
        "required",
    ),
    (
        "list-item",
        """apiVersion: v1
kind: List
items:
- apiVersion: flagella.io/v1
  kind: FlagellaNetworkPolicy
  metadata: {name: ok}
  spec: {endpointSelector: {}}
- apiVersion: flagella.io/v1
  kind: FlagellaNetworkPolicy
  metadata: {name: bad}
  spec:
    endpointSelector: {}
    ingress: [{toPorts: [{ports: [{port: "-1"}]}]}]
""",
        "items[1].spec.ingress[0].toPorts[0].ports[0].port",
        "named port",
    ),
    (
        "duplicate-names",
        """apiVersion: v1
kind: List
items:
- {apiVersion: flagella.io/v1, kind: FlagellaNetworkPolicy, metadata: {name: a}, spec: {endpointSelector: {}}}
- {apiVersion: flagella.io/v1, kind: FlagellaNetworkPolicy, metadata: {name: a}, spec: {endpointSelector: {}}}
""",
        "items[1].metadata.name",
        "appears twice",
    ),
    (
        "second-yaml-document",
        "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\nmetadata: {name: a}\n"
        "spec: {endpointSelector: {}}\n---\n"
        "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\nmetadata: {name: b}\n"
        "spec: {endpointSelector: {}, egress: [{toCIDR: [nope]}]}\n",
        "[1].spec.egress[0].toCIDR[0]",
        "not a valid CIDR",
    ),
]


@pytest.mark.parametrize(
    ("document", "path", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_parse_errors_name_the_path(document: str, path: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_document(document)
    assert info.value.field == path
    assert message in info.value.message
    assert info.value.details.startswith(f"{path}: ")
