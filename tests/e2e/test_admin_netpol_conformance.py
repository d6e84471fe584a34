"""sig-network's AdminNetworkPolicy conformance suite
(kubernetes-sigs/network-policy-api v0.1.5, conformance/tests/*-core-*.go
and conformance/base/*/core-*.yaml, the v1alpha1 API), ported onto
Kubernetes' netpol model (harness/netpol.py: x, y, z x a, b, c) on real
pods, as tests/e2e/test_netpol_upstream.py runs the NetworkPolicy suite:
the 9 pods made by `flagella-cni ADD`, the policies written to the stand-in
API server (as a cluster user does), waited for until enforced, then all 81
pairs probed on each port and protocol a step checks.

Upstream's model is 4 namespaces (gryffindor, slytherin, hufflepuff,
ravenclaw) labelled `conformance-house: <house>` with 2 pods each, serving
TCP 80 and 8080, UDP 53 and 5353, SCTP 9003 and 9005. Here:
- the houses are namespace labels: x is the subject's house, y slytherin,
  z ravenclaw or hufflepuff (relabelled between steps: upstream's rules
  name three other houses, the model has two other namespaces); a rule's
  `kubernetes.io/metadata.name: network-policy-conformance-<house>` is
  written as `conformance-house: <house>`, which selects the same pods;
- every core file has the same shape: towards ravenclaw Allow, Deny, Pass
  everything (in that order); towards slytherin Deny, then Pass, at one
  port; towards the third house Allow at one port, then Deny everything.
  The UDP files' subject is hufflepuff and their third house gryffindor:
  the same roles, played by x and z;
- ports: TCP 80 and 8080 are the model's 80 and 81, UDP 53 and 5353 its 80
  and 81, SCTP 9003 its 80;
- a file's ingress and egress policies (or rules) are applied together
  (the directions are independent: a pair's ingress is its destination's,
  its egress its source's), and the BaselineAdminNetworkPolicy singleton
  takes the ingress file's ingress rules and the egress file's egress rules;
- each step's truth table over all 81 pairs is computed by `expected`, a
  direct reading of the API's tiers over the policy objects, and upstream's
  own probes of the step (UPSTREAM) are checked against that table.

Not run: the SCTP files (admin-network-policy-core-{ingress,egress}-sctp,
baseline-admin-network-policy-core-{ingress,egress}-sctp, and the SCTP
probes of the gress files) when the kernel has no SCTP (said by
test_cases_not_run_here_are_listed); none otherwise (the SCTP steps are
the TCP ones on SCTP). The issue's cases are the integration file's: an ANP
Deny over a NetworkPolicy allow, Pass delegating to it, the baseline
applying only once no NetworkPolicy selects the pods.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from harness import netpol
from harness.netpol import Reachability
from harness.netpol_run import Env, Run, model_env, resource_of, rule_name

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

API = "policy.networking.k8s.io/v1alpha1"
HOUSE = "conformance-house"
SUBJECT, SLYTHERIN, RAVENCLAW, HUFFLEPUFF = "gryffindor", "slytherin", "ravenclaw", "hufflepuff"
X, Y, Z = netpol.NAMESPACES
SCTP_MISSING = netpol.sctp_missing()

Port = tuple[str, int]  # (protocol, the model's port)


def houses(z: str) -> dict[str, str]:
    return {X: SUBJECT, Y: SLYTHERIN, Z: z}


def peer(house: str) -> dict[str, Any]:
    return {"namespaces": {"matchLabels": {HOUSE: house}}}


def ports(*ps: Port) -> list[dict[str, Any]]:
    return [{"portNumber": {"protocol": proto, "port": port}} for proto, port in ps]


def gress(direction: str, s_ports: list[Port], h_ports: list[Port], *, baseline: bool) -> list[Any]:
    """A core file's rules of one direction (see the module docstring)."""
    key = "to" if direction == "egress" else "from"

    def rule(name: str, action: str, house: str, at: list[Port] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "action": action, key: [peer(house)]}
        if at:
            out["ports"] = ports(*at)
        return out

    rules = [
        rule("allow-ravenclaw-everything", "Allow", RAVENCLAW),
        rule("deny-ravenclaw-everything", "Deny", RAVENCLAW),
        rule("pass-ravenclaw-everything", "Pass", RAVENCLAW),
        rule("deny-slytherin-at-port", "Deny", SLYTHERIN, s_ports),
        rule("pass-slytherin-at-port", "Pass", SLYTHERIN, s_ports),
        rule("allow-third-house-at-port", "Allow", HUFFLEPUFF, h_ports),
        rule("deny-third-house-everything-else", "Deny", HUFFLEPUFF),
    ]
    if baseline:
        rules = [r for r in rules if r["action"] != "Pass"]
    return rules


def subject() -> dict[str, Any]:
    return {"namespaces": {"matchLabels": {HOUSE: SUBJECT}}}


def anp(name: str, priority: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "AdminNetworkPolicy",
        "metadata": {"name": name},
        "spec": {"priority": priority, "subject": subject(), **spec},
    }


def banp(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "BaselineAdminNetworkPolicy",
        "metadata": {"name": "default"},
        "spec": {"subject": subject(), **spec},
    }


def swap(policy: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """Upstream's mutation: rules i and j swapped, in both directions."""
    out = copy.deepcopy(policy)
    for direction in ("ingress", "egress"):
        rules = out["spec"].get(direction)
        if rules:
            rules[i], rules[j] = rules[j], rules[i]
    return out


# --- the truth: the API's tiers read directly over the objects ---


def house_of(selector: dict[str, Any]) -> str:
    """The house a subject or peer selects (namespaces, or pods with any
    pod of a namespace)."""
    if "pods" in selector:
        return str(selector["pods"]["namespaceSelector"]["matchLabels"][HOUSE])
    return str(selector["namespaces"]["matchLabels"][HOUSE])


def _first(rules: list[dict[str, Any]], direction: str, house: str, port: Port) -> str | None:
    key = "to" if direction == "egress" else "from"
    for r in rules:
        if any(house_of(p) == house for p in r[key]) and (
            "ports" not in r
            or any(
                (p["portNumber"]["protocol"], p["portNumber"]["port"]) == port for p in r["ports"]
            )
        ):
            return str(r["action"])
    return None


def _side(policies: list[dict[str, Any]], direction: str, me: str, other: str, port: Port) -> bool:
    def selects(p: dict[str, Any]) -> bool:
        return house_of(p["spec"]["subject"]) == me

    admin = sorted(
        (p for p in policies if p["kind"] == "AdminNetworkPolicy" and selects(p)),
        key=lambda p: (p["spec"]["priority"], p["metadata"]["name"]),
    )
    for p in admin:
        action = _first(p["spec"].get(direction, []), direction, other, port)
        if action == "Pass":
            break
        if action is not None:
            return action == "Allow"
    nps = [p for p in policies if p["kind"] == "NetworkPolicy" and p["house"] == me]
    if any(direction.capitalize() in p["spec"]["policyTypes"] for p in nps):
        # The integration file's NetworkPolicy: to and from slytherin only.
        return other == SLYTHERIN
    for p in policies:
        if p["kind"] == "BaselineAdminNetworkPolicy" and selects(p):
            action = _first(p["spec"].get(direction, []), direction, other, port)
            if action is not None:
                return action == "Allow"
    return True


def expected(policies: list[dict[str, Any]], z: str, port: Port) -> Reachability:
    house = houses(z)
    reach = Reachability(True)
    for src, dst in reach.expected:
        s, d = house[src.split("/")[0]], house[dst.split("/")[0]]
        reach.expected[(src, dst)] = _side(policies, "egress", s, d, port) and _side(
            policies, "ingress", d, s, port
        )
    return reach


# --- the steps ---


@dataclass
class Step:
    """One upstream subtest (or several on the same policies): the policies
    in force, the house z plays, the ports to probe, and upstream's own
    probes (client namespace, server namespace, port, allowed)."""

    name: str
    policies: list[dict[str, Any]]
    z: str
    probes: list[Port]
    upstream: list[tuple[str, str, Port, bool]]


TCP80, TCP8080 = ("TCP", 80), ("TCP", 81)
UDP53, UDP5353 = ("UDP", 80), ("UDP", 81)
SCTP9003 = ("SCTP", 80)


def rule_files(
    prefix: str,
    make: Callable[..., dict[str, Any]],
    ingress: tuple[list[Port], list[Port]],
    egress: tuple[list[Port], list[Port]],
    probes: list[Port],
    *,
    baseline: bool,
) -> list[Step]:
    """The steps of one protocol's ingress and egress files (applied
    together), with upstream's probes per step: ravenclaw (z) and
    slytherin (y) towards the subject (x), and back for egress."""
    spec = {
        "ingress": gress("ingress", *ingress, baseline=baseline),
        "egress": gress("egress", *egress, baseline=baseline),
    }
    base = make(**spec)
    p_in_s, p_in_h = ingress[0][0], ingress[1][0]
    p_e_s, p_e_h = egress[0][0], egress[1][0]
    other = next(p for p in probes if p not in (p_in_h,))
    steps = [
        Step(
            f"{prefix}: allow ordering respected; deny at the port",
            [base],
            RAVENCLAW,
            probes,
            [
                (Z, X, p_in_h, True),
                (Z, X, other, True),
                (X, Z, p_e_h, True),
                (Y, X, p_in_s, False),
                (X, Y, p_e_s, False),
            ],
        ),
        Step(
            f"{prefix}: allow at the port",
            [base],
            HUFFLEPUFF,
            probes,
            [(Z, X, p_in_h, True), (X, Z, p_e_h, True)],
        ),
    ]
    denied_first = swap(base, 0, 1)
    steps.append(
        Step(
            f"{prefix}: deny ordering respected",
            [denied_first],
            RAVENCLAW,
            probes,
            [(Z, X, p_in_h, False), (X, Z, p_e_h, False)],
        )
    )
    if baseline:
        return steps
    passed_first = swap(denied_first, 0, 2)
    steps.append(
        Step(
            f"{prefix}: pass ordering respected",
            [passed_first],
            RAVENCLAW,
            probes,
            [(Z, X, p_in_h, True), (X, Z, p_e_h, True)],
        )
    )
    steps.append(
        Step(
            f"{prefix}: pass at the port",
            [swap(passed_first, 3, 4)],
            RAVENCLAW,
            probes,
            [(Y, X, p_in_s, True), (X, Y, p_e_s, True)],
        )
    )
    return steps


def admin(priority: int) -> Callable[..., dict[str, Any]]:
    return lambda **spec: anp(f"rules-p{priority}", priority, **spec)


PROTOS = netpol.protocols()
# Per file group: (ingress (slytherin's ports, the third house's), egress
# (the same), the ports probed), and the AdminNetworkPolicy's priority.
FILE_PORTS = {
    "tcp": (([TCP80], [TCP80]), ([TCP80], [TCP8080]), [TCP80, TCP8080], 3),
    "udp": (([UDP5353], [UDP53]), ([UDP5353], [UDP53]), [UDP53, UDP5353], 4),
    "sctp": (([SCTP9003], [SCTP9003]), ([SCTP9003], [SCTP9003]), [SCTP9003], 5),
    "gress": (
        ([TCP80, UDP53, SCTP9003], [TCP80, UDP5353, SCTP9003]),
        ([TCP80, UDP53, SCTP9003], [TCP8080, UDP5353, SCTP9003]),
        [TCP80, TCP8080, UDP53, UDP5353],
        15,
    ),
}
STEPS: dict[str, list[Step]] = {}
for _what, (_in, _out, _probes, _priority) in FILE_PORTS.items():
    if _what == "sctp" and SCTP_MISSING:
        continue
    _name = "gress-rules" if _what == "gress" else f"{{ingress,egress}}-{_what}-rules"
    STEPS[f"admin-network-policy-core-{_name}"] = rule_files(
        f"ANP {_what}", admin(_priority), _in, _out, _probes, baseline=False
    )
    STEPS[f"baseline-admin-network-policy-core-{_name}"] = rule_files(
        f"BANP {_what}", banp, _in, _out, _probes, baseline=True
    )


def slytherin_step(name: str, policies: list[dict[str, Any]], *, allowed: bool) -> Step:
    """A step of the integration and priority files: slytherin (y) to and
    from the subject (x) on TCP 80, as upstream probes it."""
    return Step(
        name, policies, HUFFLEPUFF, [TCP80], [(Y, X, TCP80, allowed), (X, Y, TCP80, allowed)]
    )


def _np_allow_slytherin() -> dict[str, Any]:
    rule = {"namespaceSelector": {"matchLabels": {HOUSE: SLYTHERIN}}}
    policy = netpol.network_policy(
        X, "allow-gress-from-to-slytherin-to-gryffindor", {},
        ingress=[{"from": [rule]}], egress=[{"to": [rule]}],
    )  # fmt: skip
    return {**policy, "house": SUBJECT}  # "house": for expected(); dropped when written


def _integration() -> list[Step]:
    deny = {"action": "Deny"}
    ingress = [{"name": "deny-all-ingress-from-slytherin", **deny, "from": [peer(SLYTHERIN)]}]
    egress = [{"name": "deny-all-egress-to-slytherin", **deny, "to": [peer(SLYTHERIN)]}]
    example = anp("pass-example", 10, ingress=ingress, egress=egress)
    base = banp(ingress=copy.deepcopy(ingress), egress=copy.deepcopy(egress))
    np = _np_allow_slytherin()
    passing = copy.deepcopy(example)
    passing["spec"]["ingress"][0]["action"] = "Pass"
    passing["spec"]["egress"][0]["action"] = "Pass"
    return [
        slytherin_step(
            "ANP Deny over a NetworkPolicy allow (both directions)",
            [example, np, base],
            allowed=False,
        ),
        slytherin_step(
            "ANP Pass: the NetworkPolicy allow decides, not the baseline's deny",
            [passing, np, base],
            allowed=True,
        ),
        slytherin_step(
            "ANP Pass, the NetworkPolicy deleted: the baseline's deny decides",
            [passing, base],
            allowed=False,
        ),
    ]


def _priority() -> list[Step]:
    def pods_peer(house: str) -> dict[str, Any]:
        # Upstream's podSelector is the house label its pods carry too:
        # every pod of the namespace, as {} here.
        return {"pods": {"namespaceSelector": {"matchLabels": {HOUSE: house}}, "podSelector": {}}}

    def rules(action: str, what: str) -> dict[str, Any]:
        return {
            "ingress": [{"name": f"{what}-ingress", "action": action, "from": [pods_peer(SLYTHERIN)]}],
            "egress": [{"name": f"{what}-egress", "action": action, "to": [pods_peer(SLYTHERIN)]}],
        }  # fmt: skip

    def with_pod_subject(p: dict[str, Any]) -> dict[str, Any]:
        p["spec"]["subject"] = pods_peer(SUBJECT)
        return p

    deny50 = with_pod_subject(anp("priority-50-example", 50, **rules("Deny", "deny-all")))
    pass60 = with_pod_subject(
        anp("old-priority-60-new-priority-40-example", 60, **rules("Pass", "pass-all"))
    )
    allow = with_pod_subject(banp(**rules("Allow", "allow-all")))
    pass40 = copy.deepcopy(pass60)
    pass40["spec"]["priority"] = 40
    return [
        slytherin_step(
            "priority 50 Deny before priority 60 Pass", [deny50, pass60, allow], allowed=False
        ),
        slytherin_step(
            "priority 60 updated to 40: Pass first, the baseline allows",
            [deny50, pass40, allow],
            allowed=True,
        ),
    ]


STEPS["admin-network-policy-core-integration"] = _integration()
STEPS["admin-network-policy-core-priority"] = _priority()
SCTP_FILES = [
    "admin-network-policy-core-{ingress,egress}-sctp-rules",
    "baseline-admin-network-policy-core-{ingress,egress}-sctp-rules",
]
NOT_RUN = {f: SCTP_MISSING for f in SCTP_FILES if SCTP_MISSING}


def _probeable(port: Port) -> bool:
    return port[0] in PROTOS


# --- the run ---


class AdminRun(Run):
    """A Run whose namespaces play houses (labels), whose policies may be
    of any kind."""

    def houses(self, z: str) -> None:
        for ns, house in houses(z).items():
            obj = self.env.kube_api.get("namespaces", "", ns)
            assert obj is not None
            if obj["metadata"]["labels"].get(HOUSE) != house:
                labels = {**netpol.namespace_object(ns)["metadata"]["labels"], HOUSE: house}
                self.set_namespace_labels(ns, labels)

    def apply(self, policies: list[dict[str, Any]]) -> None:
        """The step's policies exactly: others of the run deleted."""
        keep = set()
        for p in policies:
            obj = {k: v for k, v in p.items() if k != "house"}
            name = self.create_if_changed(obj)
            keep.add(name)
        for name in [n for n in self.policies if n not in keep]:
            policy = self.policies.pop(name)
            meta = policy["metadata"]
            self.env.kube_api.delete(resource_of(policy), meta.get("namespace", ""), meta["name"])
            self.gone.add(name)
            self.rule_revisions.pop(name, None)

    def create_if_changed(self, obj: dict[str, Any]) -> str:
        name = rule_name(obj)
        if self.policies.get(name) != obj:
            self.create(obj)
        return name


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    tmp = tmp_path_factory.mktemp("anp")
    namespaces = {
        ns: {**netpol.namespace_object(ns)["metadata"]["labels"], HOUSE: house}
        for ns, house in houses(RAVENCLAW).items()
    }
    with model_env(tmp, namespaces) as (e, took):
        print(f"\n9 pods made through flagella-cni in {took:.1f}s")
        yield e


FILES = list(STEPS)


@pytest.mark.parametrize("file", FILES, ids=FILES)
def test_conformance_file(env: Env, file: str) -> None:
    run = AdminRun(env, file)
    t0 = time.monotonic()
    try:
        for step in STEPS[file]:
            run.case = f"{file}: {step.name}"
            run.apply(step.policies)
            run.houses(step.z)
            for port in step.probes:
                if _probeable(port):
                    run.validate(port[1], port[0], expected(step.policies, step.z, port))
    finally:
        run.reset()
        run.houses(RAVENCLAW)
        run.settle()
    print(f"\n{file}: {time.monotonic() - t0:.1f}s; probe rounds: {', '.join(run.rounds)}")


@pytest.mark.parametrize("file", FILES, ids=FILES)
def test_the_truth_tables_agree_with_upstreams_probes(file: str) -> None:
    """expected() says what upstream's own probes of each step say."""
    for step in STEPS[file]:
        for client, server, port, allowed in step.upstream:
            got = expected(step.policies, step.z, port).expected[(f"{client}/a", f"{server}/b")]
            assert got is allowed, (file, step.name, client, server, port)


def test_cases_not_run_here_are_listed() -> None:
    for name, reason in NOT_RUN.items():
        assert reason
        print(f"not run: {name}: {reason}")
    assert len(FILES) + len(NOT_RUN) == 10
