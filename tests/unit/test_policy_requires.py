"""fromRequires / toRequires, as Cilium defines them: the requirements of
every rule selecting an endpoint narrow every from/toEndpoints selector of
every rule selecting it (deny rules too) in that direction; they allow
nothing by themselves and leave entities, CIDRs and ports-only clauses
alone. Checked against resolved policy-map entries (policy_world), fresh
and incrementally, and through the trace."""

from __future__ import annotations

import pytest
from policy_world import World

from flagella.common.errors import InvalidArgument
from flagella.policy.identities import HOST
from flagella.policy.labels import parse_labels
from flagella.policy.rules import Protocol, Verdict, parse_document, rule_from_json, rule_to_json
from flagella.policy.trace import trace_packet


def fnp(name: str, spec: str) -> str:
    return (
        "---\napiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\n"
        f"metadata: {{name: {name}, namespace: default}}\nspec:\n{spec}"
    )


ALLOW_CLIENTS = fnp(
    "allow-clients",
    """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
""",
)
REQUIRE_PROD = fnp(
    "require-prod",
    """  endpointSelector: {}
  ingress:
  - fromRequires: [{matchLabels: {env: prod}}]
""",
)


def world() -> World:
    w = World()
    w.pod("web", "default", app="web")
    w.pod("api", "default", app="api")
    w.pod("client-prod", "default", app="client", env="prod")
    w.pod("client-dev", "default", app="client", env="dev")
    w.pod("db", "default", app="db")
    return w


def allowed(w: World, src: str, dst: str, port: int = 80) -> bool:
    return w.allowed(w.names[src], w.names[dst], port, Protocol.TCP)


def test_requirements_narrow_the_endpoint_selectors_of_every_rule() -> None:
    w = world()
    w.rules(ALLOW_CLIENTS)
    assert allowed(w, "client-dev", "web")
    w.rules(REQUIRE_PROD)
    assert allowed(w, "client-prod", "web")
    assert not allowed(w, "client-dev", "web")
    # A new identity after the fact is narrowed too.
    w.pod("client-test", "default", app="client", env="test")
    assert not allowed(w, "client-test", "web")
    w.pod("client-prod2", "default", app="client", env="prod", zone="b")
    assert allowed(w, "client-prod2", "web")
    # Deleting the requiring rule lifts it.
    w.delete_rule("default/require-prod")
    assert allowed(w, "client-dev", "web")


def test_requirements_alone_allow_nothing() -> None:
    w = world()
    w.rules(REQUIRE_PROD)
    assert not allowed(w, "client-prod", "web")
    assert not allowed(w, "client-prod", "db")


def test_requirements_leave_entities_cidrs_and_ports_only_clauses_alone() -> None:
    w = world()
    w.rules(
        fnp(
            "open",
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEntities: [host]
  - toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
""",
        )
        + REQUIRE_PROD
    )
    assert w.allowed(HOST, w.names["web"], 9999, Protocol.TCP)  # entity host
    assert allowed(w, "client-dev", "web", 8080)  # ports only: any peer
    assert not allowed(w, "client-dev", "web", 80)


def test_only_endpoints_selected_by_the_requiring_rule_are_narrowed() -> None:
    w = world()
    w.rules(
        ALLOW_CLIENTS.replace("allow-clients", "web-clients")
        + ALLOW_CLIENTS.replace("allow-clients", "api-clients").replace("app: web", "app: api")
        + REQUIRE_PROD.replace(
            "endpointSelector: {}", "endpointSelector: {matchLabels: {app: web}}"
        )
    )
    assert not allowed(w, "client-dev", "web")
    assert allowed(w, "client-dev", "api")


def test_to_requires_narrow_egress_and_deny_rules_are_narrowed_too() -> None:
    w = world()
    w.pod("db-prod", "default", app="db", env="prod")
    w.rules(
        fnp(
            "egress",
            """  endpointSelector: {matchLabels: {app: api}}
  egress:
  - toEndpoints: [{matchLabels: {app: db}}]
    toRequires: [{matchLabels: {env: prod}}]
""",
        )
        + fnp(
            "deny-clients",
            """  endpointSelector: {matchLabels: {app: db}}
  ingress:
  - fromEntities: [cluster]
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: client}}]
    fromRequires: [{matchLabels: {env: prod}}]
""",
        )
    )
    assert allowed(w, "api", "db-prod")
    assert not allowed(w, "api", "db")
    # The deny is narrowed to prod clients; the entity allow is not narrowed.
    assert not allowed(w, "client-prod", "db")
    assert allowed(w, "client-dev", "db")


def test_trace_names_the_unmet_requirement() -> None:
    w = world()
    w.rules(ALLOW_CLIENTS + REQUIRE_PROD)
    dev = parse_labels(["k8s:io.kubernetes.pod.namespace=default", "k8s:app=client", "k8s:env=dev"])
    web = parse_labels(["k8s:io.kubernetes.pod.namespace=default", "k8s:app=web"])
    trace = trace_packet(w.state, dev, web, 80, Protocol.TCP, allow_localhost=True)
    assert trace.verdict is Verdict.DENY
    assert trace.ingress is Verdict.DENY
    text = "\n".join(trace.explanation)
    assert "does not meet the requirement(s) k8s:env in (prod)" in text or (
        "does not meet the requirement" in text and "env" in text
    ), text


def test_parsing_round_trip_and_errors() -> None:
    (rule,) = parse_document(REQUIRE_PROD)
    assert rule.ingress[0].requires[0].match_labels == (("env", "prod"),)
    assert rule_from_json(rule_to_json(rule)) == rule
    with pytest.raises(InvalidArgument) as err:
        parse_document(REQUIRE_PROD.replace("fromRequires", "toRequires"))
    assert err.value.field == "spec.ingress[0].toRequires"
    with pytest.raises(InvalidArgument) as err:
        parse_document(REQUIRE_PROD.replace("{matchLabels: {env: prod}}", "{matchLabels: 3}"))
    assert err.value.field is not None
    assert err.value.field.startswith("spec.ingress[0].fromRequires[0]")
