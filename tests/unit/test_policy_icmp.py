"""ICMP type rules (`icmps`): parsing by number and by name per family,
errors naming the field, the proto API's icmp_type, the JSON kept in etcd,
and resolution into policy entries keyed as the datapath keys ICMP."""

from __future__ import annotations

import pytest

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.policy.convert import rule_from_pb, rule_pb
from flagella.policy.rules import (
    PortSpec,
    Protocol,
    compile_rule,
    icmp_port,
    icmp_type_of,
    parse_document,
    rule_from_json,
    rule_to_json,
)


def doc(icmps: str, extra: str = "") -> str:
    return f"""
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: ping, namespace: shop}}
spec:
  endpointSelector: {{matchLabels: {{app: web}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{app: client}}}}]
    icmps: {icmps}
{extra}"""


def ports(text: str) -> tuple[PortSpec, ...]:
    (rule,) = parse_document(text)
    return tuple(p for group in rule.ingress[0].to_ports for p in group)


def test_types_by_number_and_name_per_family() -> None:
    got = ports(
        doc(
            "[{fields: [{type: 8}, {type: EchoReply, family: IPv4}, "
            "{type: EchoRequest, family: IPv6}, {type: '2', family: IPv6}]}]"
        )
    )
    assert got == (
        PortSpec(icmp_port(8), 0, Protocol.ICMP),
        PortSpec(icmp_port(0), 0, Protocol.ICMP),
        PortSpec(icmp_port(128), 0, Protocol.ICMPV6),
        PortSpec(icmp_port(2), 0, Protocol.ICMPV6),
    )
    # Type 0 (echo reply) is a type, not "every type".
    assert icmp_type_of(icmp_port(0)) == 0
    assert icmp_type_of(0) is None


def test_icmps_and_to_ports_in_one_clause_allow_both() -> None:
    text = doc(
        "[{fields: [{type: 8}]}]",
        '    toPorts: [{ports: [{port: "80", protocol: TCP}]}]',
    )
    (rule,) = parse_document(text)
    compiled = compile_rule(rule)
    (clause,) = compiled.clauses
    assert set(clause.ports) == {(80, 0, Protocol.TCP), (icmp_port(8), 0, Protocol.ICMP)}


@pytest.mark.parametrize(
    ("icmps", "field", "message"),
    [
        ("[{fields: [{type: 256}]}]", "icmps[0].fields[0].type", "out of range"),
        ("[{fields: [{type: -1}]}]", "icmps[0].fields[0].type", "out of range"),
        ("[{fields: [{type: Pong}]}]", "icmps[0].fields[0].type", "unknown IPv4 ICMP type name"),
        # A name of the other family is unknown in this one.
        ("[{fields: [{type: PacketTooBig}]}]", "icmps[0].fields[0].type", "unknown IPv4"),
        ("[{fields: [{type: true}]}]", "icmps[0].fields[0].type", "expected an ICMP type"),
        ("[{fields: [{family: IPv4}]}]", "icmps[0].fields[0].type", "required"),
        ("[{fields: [{type: 8, family: IPv5}]}]", "icmps[0].fields[0].family", "unknown family"),
        ("[{fields: [{type: 8, code: 0}]}]", "icmps[0].fields[0].code", "unknown field"),
        ("[{fields: []}]", "icmps[0].fields", "at least one"),
        ("[{}]", "icmps[0].fields", "at least one"),
        ("{fields: []}", "icmps", "expected a list"),
    ],
)
def test_errors_name_the_field(icmps: str, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_document(doc(icmps))
    assert err.value.field == f"spec.ingress[0].{field}"
    assert message in str(err.value)


def _pb_rule(*ports: pb.PortProtocol) -> pb.Rule:
    return pb.Rule(
        name="shop/ping",
        endpoint_selector=pb.EndpointSelector(match_labels={"app": "web"}),
        ingress=[pb.PeerRule(to_ports=[pb.PortRule(ports=list(ports))])],
    )


def test_proto_api_icmp_type_round_trips_through_the_store_json() -> None:
    rule = rule_from_pb(
        _pb_rule(
            pb.PortProtocol(protocol=pb.PROTOCOL_ICMP, icmp_type=0),
            pb.PortProtocol(protocol=pb.PROTOCOL_ICMPV6, icmp_type=135),
            pb.PortProtocol(protocol=pb.PROTOCOL_ICMP),  # every type
        ),
        "rules.rules[0]",
    )
    assert rule.ingress[0].to_ports[0] == (
        PortSpec(icmp_port(0), 0, Protocol.ICMP),
        PortSpec(icmp_port(135), 0, Protocol.ICMPV6),
        PortSpec(0, 0, Protocol.ICMP),
    )
    assert rule_from_json(rule_to_json(rule)) == rule
    back = rule_pb(rule).ingress[0].to_ports[0].ports
    assert [(p.HasField("icmp_type"), p.icmp_type, p.port) for p in back] == [
        (True, 0, 0),
        (True, 135, 0),
        (False, 0, 0),
    ]


@pytest.mark.parametrize(
    ("port", "field", "message"),
    [
        (pb.PortProtocol(protocol=pb.PROTOCOL_ICMP, icmp_type=256), "icmp_type", "out of range"),
        (pb.PortProtocol(protocol=pb.PROTOCOL_ICMP, port=8), "port", "takes no port"),
        (pb.PortProtocol(protocol=pb.PROTOCOL_TCP, icmp_type=8), "icmp_type", "needs protocol"),
        (
            pb.PortProtocol(protocol=pb.PROTOCOL_ICMPV6, icmp_type=1, end_port=4),
            "end_port",
            "no port range",
        ),
    ],
)
def test_proto_api_errors_name_the_field(port: pb.PortProtocol, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        rule_from_pb(_pb_rule(port), "rules.rules[0]")
    assert err.value.field == f"rules.rules[0].ingress[0].to_ports[0].ports[0].{field}"
    assert message in str(err.value)
