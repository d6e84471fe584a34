"""AdminNetworkPolicy tiers (tiers.py, resolve.py): the verdict of every
(subject, peer, port) through ANP, the NetworkPolicy tier and the BANP,
checked on the resolved entries as the datapath evaluates them (the
loader's own expansion, one LPM lookup for the peer and one for identity
0, a deny in either wins) and through the trace, which must agree."""

from __future__ import annotations

import pytest
from policy_world import World

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.policy import PolicyEntry as MapEntry
from flagella.datapath.bpf.policy import expand
from flagella.policy.convert import rule_from_pb, rule_pb
from flagella.policy.resolve import PolicyContent
from flagella.policy.rules import (
    Direction,
    Protocol,
    Verdict,
    parse_document,
    rule_from_json,
    rule_to_json,
)
from flagella.policy.trace import trace_packet

MapKeys = dict[tuple[int, int, int, int, int], tuple[int, int]]


def _lpm(keys: MapKeys, ident: int, d: int, proto: int, port: int) -> int | None:
    for plen in range(L.POLICY_PREFIX_FULL, L.POLICY_PREFIX_PROTO, -1):
        bits = plen - L.POLICY_PREFIX_PROTO
        hit = keys.get((ident, d, proto, port & ((0xFFFF << (16 - bits)) & 0xFFFF), plen))
        if hit is not None:
            return hit[0]
    for key in ((ident, d, proto, 0, L.POLICY_PREFIX_PROTO), (ident, d, 0, 0, L.POLICY_PREFIX_L3)):
        if key in keys:
            return keys[key][0]
    return None


def datapath_allows(
    content: PolicyContent, peer: int, port: int, proto: Protocol, direction: Direction
) -> bool:
    enforced = (
        content.ingress_enforced if direction is Direction.INGRESS else content.egress_enforced
    )
    if not enforced:
        return True
    keys = expand(
        MapEntry(
            identity=e.identity,
            direction=L.Direction(int(e.direction)),
            verdict=L.Verdict(int(e.verdict)),
            protocol=int(e.protocol),
            port=e.port,
            end_port=e.end_port,
        )
        for e in content.entries
        if e.direction is direction
    )
    hits = {_lpm(keys, i, int(direction), int(proto), port) for i in (peer, 0)}
    if L.Verdict.DENY in hits:
        return False
    return L.Verdict.ALLOW in hits


def world() -> World:
    w = World()
    for ns in ("x", "y"):
        for pod in ("a", "b"):
            w.pod(f"{ns}/{pod}", ns, pod=pod)
    return w


def allowed(w: World, src: str, dst: str, port: int = 80, proto: Protocol = Protocol.TCP) -> bool:
    """Both directions, by the entries as the datapath reads them; the
    trace must say the same."""
    s, d = w.names[src], w.names[dst]
    out = datapath_allows(w.content(s), d, port, proto, Direction.EGRESS)
    inn = datapath_allows(w.content(d), s, port, proto, Direction.INGRESS)
    trace = trace_packet(
        w.state, w.state.info(s).labels, w.state.info(d).labels, port, proto, allow_localhost=True
    )
    assert (trace.verdict is Verdict.ALLOW) == (out and inn), "\n".join(trace.explanation)
    return out and inn


def anp(name: str, priority: int, spec: str) -> str:
    return (
        "---\napiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\n"
        f"metadata: {{name: {name}}}\nspec:\n  priority: {priority}\n{spec}"
    )


def banp(spec: str) -> str:
    return (
        "---\napiVersion: policy.networking.k8s.io/v1alpha1\n"
        f"kind: BaselineAdminNetworkPolicy\nmetadata: {{name: default}}\nspec:\n{spec}"
    )


def netpol(name: str, ns: str, spec: str) -> str:
    return (
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        f"metadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
    )


def ns_sel(ns: str) -> str:
    return f"{{namespaces: {{matchLabels: {{kubernetes.io/metadata.name: {ns}}}}}}}"


def pod_sel(ns: str, pod: str) -> str:
    return (
        f"{{pods: {{namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: {ns}}}}}, "
        f"podSelector: {{matchLabels: {{pod: {pod}}}}}}}}}"
    )


def ingress(action: str, peer: str, ports: str = "", name: str = "r") -> str:
    p = f", ports: [{ports}]" if ports else ""
    return f"  - {{name: {name}, action: {action}, from: [{peer}]{p}}}\n"


def egress(action: str, peer: str, ports: str = "", name: str = "r") -> str:
    p = f", ports: [{ports}]" if ports else ""
    return f"  - {{name: {name}, action: {action}, to: [{peer}]{p}}}\n"


def tcp(port: int) -> str:
    return f"{{portNumber: {{protocol: TCP, port: {port}}}}}"


SUBJECT_XA = f"  subject: {pod_sel('x', 'a')}\n"
SUBJECT_X = f"  subject: {ns_sel('x')}\n"
NP_DENY_ALL_XA = netpol(
    "deny", "x", "  podSelector: {matchLabels: {pod: a}}\n  policyTypes: [Ingress]\n"
)
NP_ALLOW_ALL_XA = netpol("allow", "x", "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{}]\n")


def allow80_and_deny(*, allow_priority: int, deny_priority: int) -> list[str]:
    """An ANP allowing y on TCP 80 and one denying y everything."""
    return [
        anp("deny", deny_priority, SUBJECT_XA + "  ingress:\n" + ingress("Deny", ns_sel("y"))),
        anp(
            "allow-80",
            allow_priority,
            SUBJECT_XA + "  ingress:\n" + ingress("Allow", ns_sel("y"), tcp(80)),
        ),
    ]


# (name, documents, [(src, dst, port, allowed)])
CASES = [
    (
        "ANP Allow over a NetworkPolicy default deny",
        [
            NP_DENY_ALL_XA,
            anp("allow-y", 10, SUBJECT_XA + "  ingress:\n" + ingress("Allow", ns_sel("y"))),
        ],
        [("y/a", "x/a", 80, True), ("y/b", "x/a", 9, True), ("x/b", "x/a", 80, False)],
    ),
    (
        "ANP Deny over a NetworkPolicy allow",
        [
            NP_ALLOW_ALL_XA,
            anp("deny-y", 10, SUBJECT_XA + "  ingress:\n" + ingress("Deny", ns_sel("y"))),
        ],
        [("y/a", "x/a", 80, False), ("x/b", "x/a", 80, True), ("y/a", "x/b", 80, True)],
    ),
    (
        "Pass delegates to the NetworkPolicy tier, on its ports only",
        [
            NP_ALLOW_ALL_XA,
            anp("pass", 5, SUBJECT_XA + "  ingress:\n" + ingress("Pass", ns_sel("y"), tcp(80))),
            anp("deny", 10, SUBJECT_XA + "  ingress:\n" + ingress("Deny", ns_sel("y"))),
        ],
        [("y/a", "x/a", 80, True), ("y/a", "x/a", 81, False), ("y/a", "x/a", 80, True)],
    ),
    (
        "Pass with no NetworkPolicy: the baseline decides",
        [
            anp("pass", 5, SUBJECT_XA + "  ingress:\n" + ingress("Pass", ns_sel("y"))),
            banp(SUBJECT_X + "  ingress:\n" + ingress("Deny", ns_sel("y"))),
        ],
        [("y/a", "x/a", 80, False), ("x/b", "x/a", 80, True)],
    ),
    (
        "lower priority first",
        allow80_and_deny(allow_priority=10, deny_priority=20),
        [("y/a", "x/a", 80, True), ("y/a", "x/a", 81, False), ("x/b", "x/a", 81, True)],
    ),
    (
        "higher priority later",
        allow80_and_deny(allow_priority=10, deny_priority=5),
        [("y/a", "x/a", 80, False), ("y/a", "x/a", 81, False)],
    ),
    (
        "rules of one ANP in order",
        [
            anp(
                "ordered",
                10,
                SUBJECT_XA
                + "  ingress:\n"
                + ingress("Allow", pod_sel("y", "a"), tcp(80), "first")
                + ingress("Deny", ns_sel("y"), name="second"),
            )
        ],
        [("y/a", "x/a", 80, True), ("y/a", "x/a", 81, False), ("y/b", "x/a", 80, False)],
    ),
    (
        "BANP only when no NetworkPolicy selects the pod",
        [
            netpol("allow-b", "x", "  podSelector: {matchLabels: {pod: b}}\n  ingress: [{}]\n"),
            banp(SUBJECT_X + "  ingress:\n" + ingress("Deny", ns_sel("y"))),
        ],
        [("y/a", "x/a", 80, False), ("y/a", "x/b", 80, True), ("x/b", "x/a", 80, True)],
    ),
    (
        "BANP Allow does not open what a NetworkPolicy closes",
        [NP_DENY_ALL_XA, banp(SUBJECT_X + "  ingress:\n" + ingress("Allow", ns_sel("y")))],
        [("y/a", "x/a", 80, False), ("y/a", "x/b", 80, True)],
    ),
    (
        "ANP Allow over a Cilium ingressDeny of that peer",
        [
            "---\napiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\n"
            "metadata: {name: deny-ya, namespace: x}\nspec:\n"
            "  endpointSelector: {matchLabels: {pod: a}}\n"
            "  ingress: [{fromEntities: [all]}]\n"
            "  ingressDeny:\n"
            "  - fromEndpoints: [{matchLabels: {pod: a, k8s:io.kubernetes.pod.namespace: y}}]\n",
            anp(
                "allow",
                10,
                SUBJECT_XA + "  ingress:\n" + ingress("Allow", pod_sel("y", "a"), tcp(80)),
            ),
        ],
        [("y/a", "x/a", 80, True), ("y/a", "x/a", 81, False), ("y/b", "x/a", 81, True)],
    ),
    (
        "a deny of any peer beats an ANP Allow (the datapath's limit; the trace says so)",
        [
            "---\napiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\n"
            "metadata: {name: deny-80, namespace: x}\nspec:\n"
            "  endpointSelector: {matchLabels: {pod: a}}\n"
            "  ingress: [{fromEntities: [all]}]\n"
            "  ingressDeny: [{toPorts: [{ports: [{port: '80', protocol: TCP}]}]}]\n",
            anp("allow", 10, SUBJECT_XA + "  ingress:\n" + ingress("Allow", ns_sel("y"))),
        ],
        [("y/a", "x/a", 80, False), ("y/a", "x/a", 81, True)],
    ),
    (
        "egress: ANP Deny, other peers unaffected without NetworkPolicies",
        [anp("no-y", 10, SUBJECT_X + "  egress:\n" + egress("Deny", ns_sel("y"), tcp(80)))],
        [("x/a", "y/a", 80, False), ("x/a", "y/a", 81, True), ("x/a", "x/b", 80, True)],
    ),
    (
        "port ranges and protocols",
        [
            anp(
                "range",
                10,
                SUBJECT_XA
                + "  ingress:\n"
                + ingress(
                    "Deny", ns_sel("y"), "{portRange: {protocol: UDP, start: 1000, end: 2000}}"
                ),
            ),
            NP_ALLOW_ALL_XA,
        ],
        [("y/a", "x/a", 1500, True), ("y/a", "x/a", 999, True)],
    ),
]


@pytest.mark.parametrize(("name", "docs", "checks"), CASES, ids=[c[0] for c in CASES])
def test_tiers(name: str, docs: list[str], checks: list[tuple[str, str, int, bool]]) -> None:
    w = world()
    w.rules("".join(docs))
    for src, dst, port, expect in checks:
        assert allowed(w, src, dst, port) is expect, (name, src, dst, port)


def test_udp_range_deny() -> None:
    w = world()
    w.rules(
        NP_ALLOW_ALL_XA
        + anp(
            "range",
            10,
            SUBJECT_XA
            + "  ingress:\n"
            + ingress("Deny", ns_sel("y"), "{portRange: {protocol: UDP, start: 1000, end: 2000}}"),
        )
    )
    assert not allowed(w, "y/a", "x/a", 1000, Protocol.UDP)
    assert not allowed(w, "y/a", "x/a", 2000, Protocol.UDP)
    assert allowed(w, "y/a", "x/a", 2001, Protocol.UDP)
    assert allowed(w, "y/a", "x/a", 1500, Protocol.TCP)


def test_identity_zero_is_left_to_the_network_policy_tier() -> None:
    """Admin peers are pods: the tiers change the peer's own entries only;
    identity 0's (any peer, the world) stay the NetworkPolicy tier's."""
    w = world()
    w.rules(NP_ALLOW_ALL_XA)
    before = {e for e in w.content(w.names["x/a"]).entries if e.identity == 0}
    w.rules(anp("deny-ya", 10, SUBJECT_XA + "  ingress:\n" + ingress("Deny", pod_sel("y", "a"))))
    content = w.content(w.names["x/a"])
    assert {e for e in content.entries if e.identity == 0} == before
    ya = [e for e in content.entries if e.identity == w.names["y/a"]]
    assert {(e.verdict, e.derived_from) for e in ya} == {(Verdict.DENY, ("deny-ya",))}
    assert not any(e.identity == w.names["y/b"] for e in content.entries)


def test_enforced_when_only_admin_rules_apply() -> None:
    w = world()
    w.rules(anp("deny-y", 10, SUBJECT_XA + "  ingress:\n" + ingress("Deny", ns_sel("y"))))
    content = w.content(w.names["x/a"])
    assert content.ingress_enforced
    assert not content.egress_enforced
    # An ANP with only Allow rules makes nothing default-deny.
    assert allowed(w, "x/b", "x/a", 80)


def test_incremental_identities_and_rule_changes() -> None:
    w = world()
    w.rules(anp("deny-y", 10, SUBJECT_X + "  ingress:\n" + ingress("Deny", ns_sel("y"))))
    w.pod("y/c", "y", pod="c")
    w.pod("x/c", "x", pod="c")
    assert not allowed(w, "y/c", "x/a", 80)
    assert not allowed(w, "y/a", "x/c", 80)
    w.rules(anp("deny-y", 10, SUBJECT_X + "  ingress:\n" + ingress("Allow", ns_sel("y"))))
    assert allowed(w, "y/c", "x/c", 80)
    w.rules(banp(SUBJECT_X + "  ingress:\n" + ingress("Deny", ns_sel("y"))))
    assert allowed(w, "y/c", "x/c", 80)  # the ANP allows first
    w.delete_rule("deny-y")
    assert not allowed(w, "y/c", "x/c", 80)
    w.delete_rule("default")
    assert allowed(w, "y/c", "x/c", 80)


def test_trace_names_the_deciding_rule_and_action() -> None:
    w = world()
    w.rules(
        NP_ALLOW_ALL_XA
        + anp("deny-y", 10, SUBJECT_XA + "  ingress:\n" + ingress("Deny", ns_sel("y"), name="no-y"))
    )
    s, d = w.names["y/a"], w.names["x/a"]
    trace = trace_packet(
        w.state,
        w.state.info(s).labels,
        w.state.info(d).labels,
        80,
        Protocol.TCP,
        allow_localhost=True,
    )
    assert trace.verdict is Verdict.DENY
    assert trace.matched_rules == ("deny-y",)
    assert any("deny-y ingress[0] (Deny) decides" in line for line in trace.explanation)


BAD = [
    ("priority: 1001", anp("p", 1001, SUBJECT_X), "spec.priority"),
    ("priority: -1", anp("p", -1, SUBJECT_X), "spec.priority"),
    (
        "unknown action",
        anp("p", 1, SUBJECT_X + "  ingress:\n" + ingress("Drop", ns_sel("y"))),
        "spec.ingress[0].action",
    ),
    (
        "Pass in a BANP",
        banp(SUBJECT_X + "  ingress:\n" + ingress("Pass", ns_sel("y"))),
        "spec.ingress[0].action",
    ),
    (
        "BANP not named default",
        banp(SUBJECT_X).replace("name: default", "name: other"),
        "metadata.name",
    ),
    ("no subject", anp("p", 1, "  ingress: []\n"), "spec.subject"),
    (
        "nodes peer",
        anp("p", 1, SUBJECT_X + "  egress:\n" + egress("Deny", "{nodes: {matchLabels: {a: b}}}")),
        "spec.egress[0].to[0].nodes",
    ),
    (
        "networks peer",
        anp("p", 1, SUBJECT_X + "  egress:\n" + egress("Deny", "{networks: [10.0.0.0/8]}")),
        "spec.egress[0].to[0].networks",
    ),
    (
        "nodes in ingress",
        anp("p", 1, SUBJECT_X + "  ingress:\n" + ingress("Deny", "{nodes: {}}")),
        "spec.ingress[0].from[0].nodes",
    ),
    (
        "named port",
        anp("p", 1, SUBJECT_X + "  ingress:\n" + ingress("Deny", ns_sel("y"), "{namedPort: http}")),
        "spec.ingress[0].ports[0].namedPort",
    ),
    (
        "port range backwards",
        anp(
            "p",
            1,
            SUBJECT_X
            + "  ingress:\n"
            + ingress("Deny", ns_sel("y"), "{portRange: {start: 9, end: 8}}"),
        ),
        "spec.ingress[0].ports[0].portRange.end",
    ),
    (
        "port 0",
        anp("p", 1, SUBJECT_X + "  ingress:\n" + ingress("Deny", ns_sel("y"), tcp(0))),
        "spec.ingress[0].ports[0].portNumber.port",
    ),
    (
        "no peers",
        anp("p", 1, SUBJECT_X + "  ingress:\n  - {action: Deny, from: []}\n"),
        "spec.ingress[0].from",
    ),
    (
        "namespaced",
        anp("p", 1, SUBJECT_X).replace("name: p}", "name: p, namespace: x}"),
        "metadata.namespace",
    ),
]


@pytest.mark.parametrize(("name", "doc", "field"), BAD, ids=[b[0] for b in BAD])
def test_invalid(name: str, doc: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_document(doc)
    assert err.value.field == field, (name, str(err.value))


def test_too_many_rules() -> None:
    doc = anp("p", 1, SUBJECT_X + "  ingress:\n" + ingress("Deny", ns_sel("y")) * 101)
    with pytest.raises(InvalidArgument) as err:
        parse_document(doc)
    assert err.value.field == "spec.ingress"


def test_stored_form_round_trips() -> None:
    (rule,) = parse_document(
        anp("p", 7, SUBJECT_XA + "  ingress:\n" + ingress("Pass", ns_sel("y"), tcp(80), "n1"))
    )
    assert rule.tier == "admin"
    assert rule.priority == 7
    assert rule.ingress[0].action == "Pass"
    assert rule.ingress[0].name == "n1"
    assert rule_from_json(rule_to_json(rule)).content() == rule.content()
    (base,) = parse_document(banp(SUBJECT_X + "  egress:\n" + egress("Deny", ns_sel("y"))))
    assert base.tier == "baseline"
    assert base.key == "default"
    assert rule_from_json(rule_to_json(base)).content() == base.content()


def test_proto_round_trip_and_proto_errors() -> None:
    (rule,) = parse_document(
        anp("p", 7, SUBJECT_XA + "  ingress:\n" + ingress("Pass", ns_sel("y"), tcp(80), "n1"))
    )
    msg = rule_pb(rule)
    assert msg.tier == pb.POLICY_TIER_ADMIN
    assert msg.priority == 7
    assert msg.ingress[0].action == pb.ADMIN_ACTION_PASS
    msg.name = "p"  # the key, as a put names it
    assert rule_from_pb(msg, "rules.rules[0]").content() == rule.content()
    sel = pb.EndpointSelector(match_labels={"app": "web"})
    peer = pb.PeerRule(endpoints=[sel], action=pb.ADMIN_ACTION_PASS)
    bad = [
        (
            pb.Rule(name="p", endpoint_selector=sel, tier=1, priority=1001),
            "rules.rules[0].priority",
        ),
        (
            pb.Rule(name="other", endpoint_selector=sel, tier=2, ingress=[peer]),
            "rules.rules[0].name",
        ),
        (
            pb.Rule(name="default", endpoint_selector=sel, tier=2, ingress=[peer]),
            "rules.rules[0].ingress[0].action",
        ),
        (
            pb.Rule(
                name="p", endpoint_selector=sel, tier=1, ingress=[pb.PeerRule(endpoints=[sel])]
            ),
            "rules.rules[0].ingress[0].action",
        ),
        (
            pb.Rule(name="p", endpoint_selector=sel, ingress=[peer]),
            "rules.rules[0].ingress[0].action",
        ),
        (pb.Rule(name="x/p", endpoint_selector=sel, tier=1), "rules.rules[0].namespace"),
        (
            pb.Rule(
                name="p",
                endpoint_selector=sel,
                tier=1,
                ingress=[pb.PeerRule(entities=[pb.ENTITY_WORLD], action=pb.ADMIN_ACTION_DENY)],
            ),
            "rules.rules[0].ingress[0].endpoints",
        ),
    ]
    for msg, field in bad:
        with pytest.raises(InvalidArgument) as err:
            rule_from_pb(msg, "rules.rules[0]")
        assert err.value.field == field, (msg, str(err.value))
