"""Table-driven tests of policy resolution: each case is a set of pods, a
policy document and traffic expectations. Each expectation is checked
against the resolved policy-map entries of both ends (the source's egress
and the destination's ingress) with two lookups that must agree: the rule
semantics and a most-specific-entry lookup as the datapath does."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from policy_world import FakeKV, World

from flagella.policy import keys
from flagella.policy.identities import INIT, LOCAL_SCOPE, REMOTE_NODE
from flagella.policy.labels import parse_labels
from flagella.policy.rules import Protocol

TCP, UDP, SCTP = Protocol.TCP, Protocol.UDP, Protocol.SCTP

# name -> (namespace, labels)
PODS: dict[str, tuple[str, dict[str, str]]] = {
    "web": ("default", {"app": "web"}),
    "client": ("default", {"app": "client"}),
    "db": ("default", {"app": "db", "tier": "data"}),
    "bad": ("default", {"app": "bad"}),
    "nolabel": ("default", {}),
    "client-other": ("other", {"app": "client"}),
    "web-other": ("other", {"app": "web"}),
    "team-a": (
        "alpha",
        {"app": "client", "io.cilium.k8s.namespace.labels.team": "a"},
    ),
}

Check = tuple[str, str, int, Protocol, bool]


@dataclass
class Case:
    id: str
    rules: str
    checks: list[Check]
    allow_localhost: bool = True
    extra: list[str] = field(default_factory=list)


def fnp(name: str, spec: str, namespace: str = "default") -> str:
    ns = f", namespace: {namespace}" if namespace else ""
    return (
        f"---\napiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\n"
        f"metadata: {{name: {name}{ns}}}\nspec:\n{spec}"
    )


def knp(name: str, spec: str, namespace: str = "default") -> str:
    return (
        f"---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{spec}"
    )


# Gives the world CIDR identities to talk about (for the subject "db").
CIDRS = fnp(
    "cidrs",
    """  endpointSelector: {matchLabels: {app: db}}
  egress:
  - toCIDR: [192.0.2.0/24, 10.1.0.0/16, 10.96.5.0/24, 10.0.0.0/8, 10.96.0.0/12]
  - toEntities: [all]
""",
)

CASES = [
    Case(
        "no-rule-allows-all",
        "",
        [
            ("client", "web", 80, TCP, True),
            ("web", "client", 53, UDP, True),
            ("world", "web", 443, TCP, True),
        ],
    ),
    Case(
        "matchLabels-and-port",
        fnp(
            "allow-client",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "80", protocol: TCP}]}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("client", "web", 81, TCP, False),
            ("client", "web", 80, UDP, False),
            ("bad", "web", 80, TCP, False),
            ("world", "web", 80, TCP, False),
            # namespaced rule: a client of another namespace is not selected
            ("client-other", "web", 80, TCP, False),
            # and web of another namespace is not a subject
            ("bad", "web-other", 80, TCP, True),
            # egress of web is not enforced
            ("web", "bad", 9999, UDP, True),
        ],
    ),
    Case(
        "operator-In",
        fnp(
            "in",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints:
    - matchExpressions: [{key: app, operator: In, values: [client, db]}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("db", "web", 5432, TCP, True),
            ("bad", "web", 80, TCP, False),
            ("nolabel", "web", 80, TCP, False),
        ],
    ),
    Case(
        "operator-NotIn",
        fnp(
            "notin",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints:
    - matchExpressions: [{key: app, operator: NotIn, values: [bad]}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("bad", "web", 80, TCP, False),
            # NotIn holds when the key is absent (Kubernetes semantics)
            ("nolabel", "web", 80, TCP, True),
            # scoped to the rule's namespace
            ("client-other", "web", 80, TCP, False),
        ],
    ),
    Case(
        "operator-Exists",
        fnp(
            "exists",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints:
    - matchExpressions: [{key: tier, operator: Exists}]
""",
        ),
        [("db", "web", 80, TCP, True), ("client", "web", 80, TCP, False)],
    ),
    Case(
        "operator-DoesNotExist",
        fnp(
            "dne",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints:
    - matchExpressions: [{key: tier, operator: DoesNotExist}]
""",
        ),
        [
            ("db", "web", 80, TCP, False),
            ("client", "web", 80, TCP, True),
            ("nolabel", "web", 80, TCP, True),
            # the namespace scoping keeps reserved identities out
            ("world", "web", 80, TCP, False),
        ],
    ),
    Case(
        "subject-matchExpressions",
        fnp(
            "subject-exprs",
            """  endpointSelector:
    matchExpressions: [{key: app, operator: In, values: [web, db]}]
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("bad", "web", 80, TCP, False),
            ("bad", "db", 80, TCP, False),
            ("bad", "client", 80, TCP, True),
        ],
    ),
    Case(
        "entity-world",
        CIDRS
        + fnp(
            "to-world",
            """  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEntities: [world]
""",
        ),
        [
            ("web", "world", 443, TCP, True),
            ("web", "cidr:192.0.2.0/24", 443, TCP, True),
            ("web", "client", 80, TCP, False),
            ("web", "host", 80, TCP, False),
        ],
    ),
    Case(
        "entity-cluster",
        CIDRS
        + fnp(
            "to-cluster",
            """  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEntities: [cluster]
""",
        ),
        [
            ("web", "client", 80, TCP, True),
            ("web", "client-other", 80, TCP, True),
            ("web", "host", 80, TCP, True),
            ("web", "remote-node", 80, TCP, True),
            ("web", "world", 80, TCP, False),
            ("web", "cidr:192.0.2.0/24", 80, TCP, False),
        ],
    ),
    Case(
        "entity-host-and-remote-node",
        fnp(
            "from-nodes",
            """  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEntities: [host]
  - toEntities: [remote-node]
    toPorts: [{ports: [{port: "10250", protocol: TCP}]}]
""",
        ),
        [
            ("web", "host", 22, TCP, True),
            ("web", "remote-node", 10250, TCP, True),
            ("web", "remote-node", 22, TCP, False),
            ("web", "client", 80, TCP, False),
        ],
    ),
    Case(
        "entity-all",
        CIDRS
        + fnp(
            "to-all",
            """  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEntities: [all]
    toPorts: [{ports: [{port: "53", protocol: UDP}]}]
""",
        ),
        [
            ("web", "world", 53, UDP, True),
            ("web", "cidr:192.0.2.0/24", 53, UDP, True),
            ("web", "client", 53, UDP, True),
            ("web", "client", 53, TCP, False),
        ],
    ),
    Case(
        "cidr-with-except",
        CIDRS
        + fnp(
            "to-ten",
            """  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toCIDRSet: [{cidr: 10.0.0.0/8, except: [10.96.0.0/12]}]
""",
        ),
        [
            ("web", "cidr:10.0.0.0/8", 80, TCP, True),
            ("web", "cidr:10.1.0.0/16", 80, TCP, True),
            ("web", "cidr:10.96.0.0/12", 80, TCP, False),
            ("web", "cidr:10.96.5.0/24", 80, TCP, False),
            ("web", "cidr:192.0.2.0/24", 80, TCP, False),
            ("web", "world", 80, TCP, False),
            ("web", "client", 80, TCP, False),
        ],
    ),
    Case(
        "cidr-zero-is-world",
        CIDRS
        + fnp(
            "to-any-ip",
            """  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toCIDR: [0.0.0.0/0]
""",
        ),
        [
            ("web", "world", 80, TCP, True),
            ("web", "cidr:10.96.0.0/12", 80, TCP, True),
            ("web", "client", 80, TCP, False),
        ],
    ),
    Case(
        "port-ranges-and-protocols",
        fnp(
            "ranges",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts:
    - ports:
      - {port: "8000", endPort: 8080, protocol: TCP}
      - {port: "53"}
  - fromEndpoints: [{matchLabels: {app: db}}]
    toPorts: [{ports: [{port: "0", protocol: UDP}]}]
""",
        ),
        [
            ("client", "web", 8000, TCP, True),
            ("client", "web", 8040, TCP, True),
            ("client", "web", 8080, TCP, True),
            ("client", "web", 7999, TCP, False),
            ("client", "web", 8081, TCP, False),
            ("client", "web", 8040, UDP, False),
            # ANY on a port: TCP, UDP and SCTP
            ("client", "web", 53, TCP, True),
            ("client", "web", 53, UDP, True),
            ("client", "web", 53, SCTP, True),
            # port 0: every port of the protocol
            ("db", "web", 12345, UDP, True),
            ("db", "web", 12345, TCP, False),
        ],
    ),
    Case(
        "deny-beats-allow",
        fnp(
            "allow-namespace",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{}]
""",
        )
        + fnp(
            "deny-bad",
            """  endpointSelector: {matchLabels: {app: web}}
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: bad}}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("bad", "web", 80, TCP, False),
            ("bad", "web", 22, UDP, False),
        ],
    ),
    Case(
        "deny-port-over-allow-all-ports",
        fnp(
            "deny-ssh",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
  ingressDeny:
  - toPorts: [{ports: [{port: "22", protocol: TCP}]}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("client", "web", 22, TCP, False),
            ("client", "web", 22, UDP, True),
        ],
    ),
    Case(
        "deny-peer-over-allow-any-peer-on-port",
        fnp(
            "port-open-but-not-for-bad",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - toPorts: [{ports: [{port: "80", protocol: TCP}]}]
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: bad}}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("world", "web", 80, TCP, True),
            ("bad", "web", 80, TCP, False),
            ("client", "web", 81, TCP, False),
        ],
    ),
    Case(
        "deny-range-inside-allow-range",
        fnp(
            "holes",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "8000", endPort: 9000, protocol: TCP}]}]
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "8080", endPort: 8090, protocol: ANY}]}]
""",
        ),
        [
            ("client", "web", 8000, TCP, True),
            ("client", "web", 8079, TCP, True),
            ("client", "web", 8080, TCP, False),
            ("client", "web", 8085, TCP, False),
            ("client", "web", 8090, TCP, False),
            ("client", "web", 8091, TCP, True),
        ],
    ),
    Case(
        "default-deny-per-direction",
        fnp(
            "egress-only",
            """  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEndpoints: [{matchLabels: {app: db}}]
    toPorts: [{ports: [{port: "5432", protocol: TCP}]}]
""",
        ),
        [
            ("web", "db", 5432, TCP, True),
            ("web", "db", 5433, TCP, False),
            ("web", "client", 80, TCP, False),
            # ingress of web: no rule selects it there
            ("client", "web", 80, TCP, True),
            ("world", "web", 80, TCP, True),
        ],
    ),
    Case(
        "empty-ingress-clause-denies-all-ingress",
        fnp(
            "deny-all-in",
            """  endpointSelector: {}
  ingress:
  - {}
""",
        ),
        [
            ("client", "web", 80, TCP, False),
            ("web", "db", 80, TCP, False),
            ("web", "client-other", 80, TCP, True),
            ("web", "world", 80, TCP, True),
        ],
    ),
    Case(
        "deny-only-rule-enforces",
        fnp(
            "deny-bad-only",
            """  endpointSelector: {matchLabels: {app: web}}
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: bad}}]
""",
        ),
        [("bad", "web", 80, TCP, False), ("client", "web", 80, TCP, False)],
    ),
    Case(
        "allow-localhost",
        fnp(
            "only-client",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
""",
        ),
        [("host", "web", 80, TCP, True), ("world", "web", 80, TCP, False)],
    ),
    Case(
        "allow-localhost-off",
        fnp(
            "only-client",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
""",
        ),
        [("host", "web", 80, TCP, False), ("client", "web", 80, TCP, True)],
        allow_localhost=False,
    ),
    Case(
        "deny-host-beats-allow-localhost",
        fnp(
            "no-host",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
  ingressDeny:
  - fromEntities: [host]
""",
        ),
        [("host", "web", 80, TCP, False), ("client", "web", 80, TCP, True)],
    ),
    Case(
        "peer-selector-naming-namespace",
        fnp(
            "cross-ns",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints:
    - matchLabels: {app: client, k8s:io.kubernetes.pod.namespace: other}
""",
        ),
        [("client-other", "web", 80, TCP, True), ("client", "web", 80, TCP, False)],
    ),
    Case(
        "cluster-wide-empty-peer-selects-all-pods",
        fnp(
            "cw",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{}]
""",
            namespace="",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("client-other", "web-other", 80, TCP, True),
            ("world", "web", 80, TCP, False),
            ("remote-node", "web", 80, TCP, False),
        ],
    ),
    Case(
        "reserved-init-subject",
        fnp(
            "init-dns-only",
            """  endpointSelector: {matchLabels: {reserved:init: ""}}
  egress:
  - toEndpoints: [{matchLabels: {k8s:app: db}}]
""",
            namespace="",
        )
        + fnp(
            "everyone",
            """  endpointSelector: {}
  egress:
  - toEntities: [world]
""",
            namespace="",
        ),
        [
            ("init", "db", 53, UDP, True),
            ("init", "web", 53, UDP, False),
            # the cluster-wide {} selector does not select init
            ("init", "world", 53, UDP, False),
            ("web", "world", 53, UDP, True),
        ],
    ),
    # --- Kubernetes NetworkPolicy ---
    Case(
        "k8s-empty-podSelector",
        knp(
            "from-clients",
            """  podSelector: {}
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
""",
        ),
        [
            ("client", "web", 80, TCP, True),
            ("client", "db", 5432, TCP, True),
            ("bad", "web", 80, TCP, False),
            ("client-other", "web", 80, TCP, False),
            ("world", "db", 80, TCP, False),
            # pods of other namespaces are not selected
            ("bad", "web-other", 80, TCP, True),
            # egress is not part of this policy
            ("web", "world", 443, TCP, True),
        ],
    ),
    Case(
        "k8s-policyTypes-egress-only",
        knp(
            "egress-to-db",
            """  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{podSelector: {matchLabels: {app: db}}}]
    ports: [{port: 5432}]
""",
        ),
        [
            ("web", "db", 5432, TCP, True),
            ("web", "db", 5432, UDP, False),
            ("web", "db", 80, TCP, False),
            ("web", "world", 443, TCP, False),
            ("client", "web", 80, TCP, True),
            ("world", "web", 80, TCP, True),
        ],
    ),
    Case(
        "k8s-ingress-type-without-rules-denies",
        knp(
            "deny-in",
            """  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress]
""",
        ),
        [("client", "web", 80, TCP, False), ("web", "client", 80, TCP, True)],
    ),
    Case(
        "k8s-default-policyTypes",
        knp(
            "implicit",
            """  podSelector: {matchLabels: {app: web}}
  egress:
  - to: [{podSelector: {matchLabels: {app: db}}}]
""",
        ),
        [
            ("client", "web", 80, TCP, False),
            ("web", "db", 80, TCP, True),
            ("web", "client", 80, TCP, False),
        ],
    ),
    Case(
        "k8s-allow-all-ingress",
        knp(
            "all-in",
            """  podSelector: {matchLabels: {app: web}}
  ingress: [{}]
""",
        ),
        [("world", "web", 80, TCP, True), ("client-other", "web", 9, UDP, True)],
    ),
    Case(
        "k8s-ports-only",
        knp(
            "http-from-anywhere",
            """  podSelector: {matchLabels: {app: web}}
  ingress:
  - ports: [{port: 80}, {port: 8000, endPort: 8001, protocol: TCP}]
""",
        ),
        [
            ("world", "web", 80, TCP, True),
            ("client", "web", 8001, TCP, True),
            ("client", "web", 8002, TCP, False),
            ("client", "web", 80, UDP, False),
        ],
    ),
    Case(
        "k8s-namespaceSelector",
        knp(
            "from-team-a",
            """  podSelector: {matchLabels: {app: web}}
  ingress:
  - from:
    - namespaceSelector: {matchLabels: {team: a}}
      podSelector: {matchLabels: {app: client}}
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: other}}
""",
        ),
        [
            ("team-a", "web", 80, TCP, True),
            ("client-other", "web", 80, TCP, True),
            ("client", "web", 80, TCP, False),
        ],
    ),
    Case(
        "k8s-empty-namespaceSelector",
        knp(
            "any-namespace",
            """  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{namespaceSelector: {}}]
""",
        ),
        [
            ("client-other", "web", 80, TCP, True),
            ("team-a", "web", 80, TCP, True),
            ("world", "web", 80, TCP, False),
        ],
    ),
    Case(
        "k8s-ipBlock-except",
        CIDRS
        + knp(
            "egress-ten",
            """  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.96.0.0/12]}}]
""",
        ),
        [
            ("web", "cidr:10.1.0.0/16", 443, TCP, True),
            ("web", "cidr:10.96.5.0/24", 443, TCP, False),
            ("web", "world", 443, TCP, False),
        ],
    ),
]


def build(case: Case) -> World:
    world = World(allow_localhost=case.allow_localhost)
    for name, (ns, labels) in PODS.items():
        world.pod(name, ns, **labels)
    world.names["remote-node"] = REMOTE_NODE
    world.names["init"] = INIT
    if case.rules:
        world.rules(case.rules)
    return world


def resolve_name(world: World, name: str) -> int:
    if name.startswith("cidr:"):
        return world.cidr(name[5:])
    return world.names[name]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_resolution(case: Case) -> None:
    world = build(case)
    failures = []
    for src, dst, port, proto, expected in case.checks:
        got = world.allowed(resolve_name(world, src), resolve_name(world, dst), port, proto)
        if got != expected:
            failures.append(f"{src} -> {dst} {port}/{proto.name}: expected {expected}, got {got}")
    assert not failures, "\n".join(failures)


def test_exact_entries_of_a_simple_policy() -> None:
    world = build(CASES[1])
    web, client = world.names["web"], world.names["client"]
    assert world.entries(web) == {
        (0, 0, 0, "ANY", "EGRESS", "ALLOW"),  # egress not enforced
        (1, 0, 0, "ANY", "INGRESS", "ALLOW"),  # allow-localhost
        (client, 80, 0, "TCP", "INGRESS", "ALLOW"),
    }
    content = world.content(web)
    assert content.ingress_enforced
    assert not content.egress_enforced
    derived = {e.identity: e.derived_from for e in content.entries}
    assert derived[client] == ("default/allow-client",)
    # an identity no rule selects: allow all both ways
    assert world.entries(client) == {
        (0, 0, 0, "ANY", "INGRESS", "ALLOW"),
        (0, 0, 0, "ANY", "EGRESS", "ALLOW"),
    }


def test_deny_overlap_becomes_an_explicit_deny_entry() -> None:
    world = build(next(c for c in CASES if c.id == "deny-peer-over-allow-any-peer-on-port"))
    web, bad = world.names["web"], world.names["bad"]
    entries = world.entries(web)
    assert (0, 80, 0, "TCP", "INGRESS", "ALLOW") in entries
    assert (bad, 0, 0, "ANY", "INGRESS", "DENY") in entries
    # the overlap, more specific than both
    assert (bad, 80, 0, "TCP", "INGRESS", "DENY") in entries


def test_cidr_identities_are_local_scope_and_in_the_ipcache() -> None:
    world = build(CASES[0])
    world.rules(CIDRS)
    ident = world.cidr("10.96.0.0/12")
    assert ident > LOCAL_SCOPE
    entry = world.state.ipcache_entry("10.96.0.0/12")
    assert entry is not None
    assert entry.source == "cidr-policy"
    for texts in (["cidr:10.96.0.0/12"], ["cidr:10.96.0.0/12", "reserved:world"]):
        assert world.state.identity_of_labels(parse_labels(texts)) == ident
    # same prefixes, same identities, whatever the order of the rules
    other = World()
    other.rules(CIDRS)
    assert other.cidr("10.96.0.0/12") == ident
    # gone with the last rule that used it
    world.delete_rule("default/cidrs")
    assert world.state.ipcache_entry("10.96.0.0/12") is None


def test_budget_exceeded_fails_closed() -> None:
    world = World(budget=5)
    web = world.pod("web", "default", app="web")
    for i in range(10):
        world.pod(f"c{i}", "default", app="client")
    world.rules(
        fnp(
            "many",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
""",
        )
    )
    content = world.content(web)
    assert content.error
    assert "budget" in content.error
    assert content.entries == ()
    assert content.ingress_enforced
    assert content.egress_enforced
    assert world.state.resolver.entry_count(web) > 5
    # removing peers brings it back under budget
    for i in range(8):
        world.remove_identity(f"c{i}")
    content = world.content(web)
    assert not content.error
    assert len(content.entries) == 4


def test_incremental_updates_touch_only_affected_identities() -> None:
    world = build(CASES[1])
    web = world.names["web"]
    world.content(web)
    world.state.resolver.take_dirty()
    # a new client pod: web's policy (it allows clients) changes, nothing else
    new = world.pod("client-2", "default", app="client")
    assert world.state.commit(world.rev).dirty == set()  # already reported
    assert (new, 80, 0, "TCP", "INGRESS", "ALLOW") in world.entries(web)
    world2 = build(CASES[1])
    world2.content(world2.names["web"])
    world2.state.resolver.take_dirty()
    world2.rev += 1
    world2.state.put(
        FakeKV(
            keys.id_key(999),
            keys.dumps({"labels": ["k8s:app=client", "k8s:io.kubernetes.pod.namespace=default"]}),
            world2.rev,
            world2.rev,
        )
    )
    change = world2.state.commit(world2.rev)
    assert change.dirty == {999, world2.names["web"]}
    # a rule change: only what the rule selects (db), then only db again
    world2.rules(
        fnp(
            "db-only",
            """  endpointSelector: {matchLabels: {app: db}}
  ingress: [{}]
""",
        )
    )
    assert world2.last_change.dirty == {world2.names["db"]}
    world2.delete_rule("default/db-only")
    assert world2.last_change.dirty == {world2.names["db"]}


def _random_pods(rng: random.Random, n: int) -> list[tuple[str, dict[str, str]]]:
    out = []
    for _ in range(n):
        labels = {"app": rng.choice(["x", "y", "z"])}
        if rng.random() < 0.5:
            labels["tier"] = rng.choice(["1", "2"])
        out.append((rng.choice(["a", "b"]), labels))
    return out


def _random_rule(rng: random.Random, i: int) -> str:
    def selector() -> str:
        kind = rng.randrange(5)
        if kind == 0:
            return "{}"
        if kind == 1:
            return f"{{matchLabels: {{app: {rng.choice('xyz')}}}}}"
        op = rng.choice(["In", "NotIn", "Exists", "DoesNotExist"])
        values = (
            f", values: [{rng.choice('xyz')}, '{rng.choice('12')}']"
            if op in ("In", "NotIn")
            else ""
        )
        key = rng.choice(["app", "tier"])
        return f"{{matchExpressions: [{{key: {key}, operator: {op}{values}}}]}}"

    def peer(direction: str) -> str:
        pre = "from" if direction == "in" else "to"
        kind = rng.randrange(4)
        ports = ""
        if rng.random() < 0.6:
            p = rng.choice(["80", "443", "8000"])
            end = ", endPort: 8100" if p == "8000" else ""
            proto = rng.choice(["TCP", "UDP", "ANY"])
            ports = f"\n    toPorts: [{{ports: [{{port: '{p}'{end}, protocol: {proto}}}]}}]"
        if kind == 0:
            return f"  - {pre}Endpoints: [{selector()}]{ports}"
        if kind == 1:
            return f"  - {pre}Entities: [{rng.choice(['world', 'cluster', 'host', 'all'])}]{ports}"
        if kind == 2:
            return f"  - {pre}CIDRSet: [{{cidr: 10.0.0.0/8, except: [10.{rng.randrange(4)}.0.0/16]}}]{ports}"
        return (
            "  - toPorts: [{ports: [{port: '22', protocol: TCP}]}]"
            if ports == ""
            else f"  -{ports[4:]}"
        )

    sections = []
    for name, direction in (
        ("ingress", "in"),
        ("ingressDeny", "in"),
        ("egress", "out"),
        ("egressDeny", "out"),
    ):
        if rng.random() < 0.4:
            sections.append(
                f"  {name}:\n" + "\n".join(peer(direction) for _ in range(rng.randrange(1, 3)))
            )
    body = f"  endpointSelector: {selector()}\n" + "\n".join(sections) + "\n"
    return fnp(f"r{i}", body, namespace=rng.choice(["a", "b", ""]))


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_fresh(seed: int) -> None:
    """Random sequences of identity and rule changes: the incrementally
    maintained resolver gives exactly what one built from scratch gives."""
    rng = random.Random(seed)
    world = World(budget=100000)
    live_pods: dict[str, tuple[str, dict[str, str]]] = {}
    live_rules: dict[str, str] = {}
    pods = _random_pods(rng, 30)
    counter = 0
    for _ in range(60):
        op = rng.random()
        if op < 0.35 or not live_pods:
            ns, labels = pods[counter % len(pods)]
            name = f"p{counter}"
            counter += 1
            world.pod(name, ns, **labels)
            live_pods[name] = (ns, labels)
        elif op < 0.5:
            name = rng.choice(sorted(live_pods))
            world.remove_identity(name)
            del live_pods[name]
        elif op < 0.85 or not live_rules:
            i = rng.randrange(8)
            doc = _random_rule(rng, i)
            rule = world.rules(doc)[0]
            live_rules[rule.key] = doc
        else:
            key = rng.choice(sorted(live_rules))
            world.delete_rule(key)
            del live_rules[key]
        # query some identities now and then (so cached signatures exist)
        for name in rng.sample(sorted(live_pods), min(3, len(live_pods))):
            world.content(world.names[name])
    fresh = World(budget=100000)
    for name, (ns, labels) in live_pods.items():
        texts = [f"k8s:{k}={v}" for k, v in labels.items()]
        fresh.identity(
            name, f"k8s:io.kubernetes.pod.namespace={ns}", *texts, ident=world.names[name]
        )
    for doc in live_rules.values():
        fresh.rules(doc)
    assert set(fresh.state.cidr) == set(world.state.cidr)
    for name in sorted(live_pods):
        ident = world.names[name]
        assert world.content(ident) == fresh.content(ident), f"{name} ({ident}) differs"
        # and both ends agree on a few flows
    names = sorted(live_pods)
    for src in names[:5]:
        for dst in names[:5]:
            for port in (22, 80, 8050):
                a = world.allowed(world.names[src], world.names[dst], port, TCP)
                b = fresh.allowed(fresh.names[src], fresh.names[dst], port, TCP)
                assert a == b
