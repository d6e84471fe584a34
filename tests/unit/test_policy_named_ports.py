"""Named ports in policy: parsing and validation (the field path of every
error), the stored JSON and the proto API, and resolution, which keeps
them symbolic (name and protocol) for the datapath to resolve."""

from __future__ import annotations

import pytest
from policy_world import World

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.common.portnames import port_name_error
from flagella.policy.convert import rule_from_pb, rule_pb
from flagella.policy.rules import (
    PortSpec,
    Protocol,
    compile_rule,
    parse_document,
    rule_from_json,
    rule_to_json,
)


def _fnp(ports: str, direction: str = "ingress") -> str:
    return (
        "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\n"
        "metadata: {name: p, namespace: n}\nspec:\n  endpointSelector: {}\n"
        f"  {direction}:\n  - toPorts: [{{ports: [{ports}]}}]\n"
    )


def _knp(ports: str) -> str:
    return (
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        "metadata: {name: p, namespace: n}\nspec:\n  podSelector: {}\n"
        f"  ingress:\n  - ports: [{ports}]\n"
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("http", ""),
        ("serve-80-tcp", ""),
        ("a", ""),
        ("x123456789abcde", ""),
        ("", "empty"),
        ("x123456789abcdef", "longer than 15"),
        ("Http", "lowercase"),
        ("-http", "starting and ending"),
        ("http-", "starting and ending"),
        ("web--1", "'--'"),
        ("8080", "at least one letter"),
        ("web_1", "lowercase letters"),
    ],
)
def test_port_name_rules(name: str, reason: str) -> None:
    error = port_name_error(name)
    if reason:
        assert reason in error
    else:
        assert error == ""


def test_named_ports_parse_in_both_formats() -> None:
    (rule,) = parse_document(_fnp("{port: http, protocol: TCP}, {port: dns}"))
    assert rule.ingress[0].to_ports == (
        (PortSpec(0, 0, Protocol.TCP, "http"), PortSpec(0, 0, Protocol.ANY, "dns")),
    )
    (k8s,) = parse_document(_knp("{port: serve-80-tcp}, {port: serve-81-udp, protocol: UDP}"))
    # Kubernetes' default protocol is TCP, named or not.
    assert k8s.ingress[0].to_ports == (
        (
            PortSpec(0, 0, Protocol.TCP, "serve-80-tcp"),
            PortSpec(0, 0, Protocol.UDP, "serve-81-udp"),
        ),
    )
    (egress,) = parse_document(_fnp("{port: db, protocol: SCTP}", "egressDeny"))
    assert egress.egress_deny[0].to_ports == ((PortSpec(0, 0, Protocol.SCTP, "db"),),)


@pytest.mark.parametrize(
    ("document", "path", "message"),
    [
        (_fnp("{port: Http}"), "spec.ingress[0].toPorts[0].ports[0].port", "lowercase"),
        (_fnp("{port: web--1}"), "spec.ingress[0].toPorts[0].ports[0].port", "'--'"),
        (
            _fnp("{port: a-very-long-port-name}"),
            "spec.ingress[0].toPorts[0].ports[0].port",
            "longer than 15",
        ),
        (
            _fnp("{port: http, endPort: 90}", "egress"),
            "spec.egress[0].toPorts[0].ports[0].endPort",
            "cannot start at a named port",
        ),
        (
            _fnp("{port: 80, endPort: http}"),
            "spec.ingress[0].toPorts[0].ports[0].endPort",
            "expected a port number",
        ),
        (
            _knp("{port: serve-80, endPort: 90}"),
            "spec.ingress[0].ports[0].endPort",
            "cannot start at a named port",
        ),
        (_knp("{port: SERVE}"), "spec.ingress[0].ports[0].port", "invalid named port"),
    ],
)
def test_malformed_named_ports_name_the_field(document: str, path: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_document(document)
    assert info.value.field == path
    assert message in info.value.message


def test_named_ports_round_trip_json_and_proto() -> None:
    (rule,) = parse_document(_fnp("{port: http, protocol: TCP}, {port: '80'}"))
    assert rule_from_json(rule_to_json(rule)).content() == rule.content()
    back = rule_from_pb(rule_pb(rule), "rules[0]")
    assert back.ingress == rule.ingress


def test_proto_api_named_port_errors_name_the_proto_field() -> None:
    def put(port: pb.PortProtocol) -> None:
        rule_from_pb(
            pb.Rule(
                name="p",
                namespace="n",
                endpoint_selector=pb.EndpointSelector(),
                ingress=[pb.PeerRule(to_ports=[pb.PortRule(ports=[port])])],
            ),
            "rules.rules[0]",
        )

    put(pb.PortProtocol(name="http", protocol=pb.PROTOCOL_TCP))
    with pytest.raises(InvalidArgument) as info:
        put(pb.PortProtocol(name="HTTP"))
    assert info.value.field == "rules.rules[0].ingress[0].to_ports[0].ports[0].port"
    with pytest.raises(InvalidArgument) as info:
        put(pb.PortProtocol(name="http", end_port=90))
    assert info.value.field == "rules.rules[0].ingress[0].to_ports[0].ports[0].end_port"
    with pytest.raises(InvalidArgument) as info:
        put(pb.PortProtocol(name="http", port=80))
    assert info.value.field == "rules.rules[0].ingress[0].to_ports[0].ports[0].port"


def test_compile_expands_any_protocol_per_name() -> None:
    (rule,) = parse_document(_fnp("{port: http}, {port: '80', protocol: TCP}"))
    (clause,) = compile_rule(rule).clauses
    assert clause.ports == (
        (80, 0, Protocol.TCP),
        ("http", 0, Protocol.TCP),
        ("http", 0, Protocol.UDP),
        ("http", 0, Protocol.SCTP),
    )


def _named(world: World, ident: int) -> set[tuple[int, str, str, str, str]]:
    return {
        (e.identity, e.port_name, e.protocol.name, e.direction.name, e.verdict.name)
        for e in world.content(ident).entries
        if e.port_name
    }


def _web_and_client(rules: str) -> tuple[World, int, int]:
    """A world with pods web and client (namespace default) and rules."""
    w = World()
    web = w.pod("web", "default", app="web")
    client = w.pod("client", "default", app="client")
    w.rules(rules)
    return w, web, client


def test_resolution_keeps_named_ports_symbolic() -> None:
    w, web, client = _web_and_client(
        """apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web, namespace: default}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
    ports: [{port: serve-80-tcp}, {port: '81'}]
---
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: client, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toEndpoints: [{matchLabels: {app: web}}]
    toPorts: [{ports: [{port: serve-80-udp, protocol: UDP}]}]
"""
    )
    assert _named(w, web) == {(client, "serve-80-tcp", "TCP", "INGRESS", "ALLOW")}
    assert _named(w, client) == {(web, "serve-80-udp", "UDP", "EGRESS", "ALLOW")}
    numeric = [e for e in w.content(web).entries if e.identity == client and not e.port_name]
    assert [(e.port, e.protocol.name) for e in numeric] == [(81, "TCP")]
    # A named entry carries no number.
    assert all(e.port == 0 and e.end_port == 0 for e in w.content(web).entries if e.port_name)


def test_deny_over_allow_with_named_ports() -> None:
    w, web, client = _web_and_client(
        """apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - toPorts: [{ports: [{port: http, protocol: TCP}, {port: admin, protocol: TCP}]}]
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: admin, protocol: TCP}]}]
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: '9000', protocol: TCP}]}]
"""
    )
    named = _named(w, web)
    # The allow of any peer stays; the client's deny of the same name is
    # its own entry (a datapath takes the peer's deny over the 0 allow).
    assert (0, "admin", "TCP", "INGRESS", "ALLOW") in named
    assert (0, "http", "TCP", "INGRESS", "ALLOW") in named
    assert (client, "admin", "TCP", "INGRESS", "DENY") in named
    # A numeric deny and a named allow: their overlap is only known once
    # the name has a number, so neither is turned into the other here.
    entries = {(e.identity, e.port, e.port_name, e.verdict.name) for e in w.content(web).entries}
    assert (client, 9000, "", "DENY") in entries


def test_deny_of_every_port_covers_a_named_allow() -> None:
    w, web, client = _web_and_client(
        """apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: http, protocol: TCP}]}]
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: client}}]
"""
    )
    named = _named(w, web)
    assert (client, "http", "TCP", "INGRESS", "DENY") in named
    assert (client, "http", "TCP", "INGRESS", "ALLOW") not in named
