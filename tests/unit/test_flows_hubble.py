"""flagella.common.flows: a datapath Flow as a `hubble observe -o json` line
(validated against tests/schemas/hubble-flow.schema.json), drop reasons by
Cilium's names, and the filters on names and labels."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from flagella.api.datapath.v1 import datapath_pb2 as dp
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.cli.base import CliError
from flagella.cli.observe import observe_request, parse_since
from flagella.common import flows

SCHEMA = json.loads((Path(__file__).parents[1] / "schemas" / "hubble-flow.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

DIRECTORY = flows.Directory(
    pods={
        "10.0.0.5": flows.Pod("other-7f9", "shop", 12, "n1"),
        "10.0.0.6": flows.Pod("db-0", "shop", 13, "n2"),
    },
    labels={
        300: ("k8s:app=other", "k8s:io.kubernetes.pod.namespace=shop"),
        301: ("k8s:app=db", "k8s:io.kubernetes.pod.namespace=shop", "k8s:tier=data"),
        1: ("reserved:host",),
        2: ("reserved:world",),
    },
)


def flow(**kw: Any) -> dp.Flow:
    f = dp.Flow(
        type=dp.FLOW_TYPE_DROP,
        verdict=dp.FLOW_VERDICT_DROPPED,
        drop_reason=dp.DROP_REASON_POLICY_L3,
        direction=dp.FLOW_DIRECTION_INGRESS,
        src_ip="10.0.0.5",
        dst_ip="10.0.0.6",
        src_port=40000,
        dst_port=5432,
        protocol=6,
        src_identity=300,
        dst_identity=301,
        endpoint_id=13,
        ifindex=7,
        node="n2",
        tcp_flags=0x02,
    )
    f.time.FromNanoseconds(1_764_000_000_123_456_789)
    for k, v in kw.items():
        if k == "dns":
            f.dns.CopyFrom(v)
        else:
            setattr(f, k, v)
    return f


def test_a_policy_drop_in_hubbles_shape() -> None:
    line = flows.to_hubble(flow(), DIRECTORY)
    VALIDATOR.validate(line)
    assert line["node_name"] == "n2"
    assert line["time"] == line["flow"]["time"] == "2025-11-24T16:00:00.123456789Z"
    f = line["flow"]
    assert (f["verdict"], f["drop_reason"], f["drop_reason_desc"]) == (
        "DROPPED",
        133,
        "POLICY_DENIED",
    )
    assert f["event_type"] == {"type": 1, "sub_type": 133}
    assert f["IP"] == {"source": "10.0.0.5", "destination": "10.0.0.6", "ipVersion": "IPv4"}
    assert f["l4"] == {
        "TCP": {"source_port": 40000, "destination_port": 5432, "flags": {"SYN": True}}
    }
    assert f["Summary"] == "TCP Flags: SYN"
    assert f["traffic_direction"] == "INGRESS"
    # Ingress: the local endpoint is the destination; the source's id is its own.
    assert f["destination"] == {
        "ID": 13,
        "identity": 301,
        "namespace": "shop",
        "labels": ["k8s:app=db", "k8s:io.kubernetes.pod.namespace=shop", "k8s:tier=data"],
        "pod_name": "db-0",
    }
    assert f["source"]["pod_name"] == "other-7f9"
    assert f["interface"] == {"index": 7}


def test_other_shapes_validate_too() -> None:
    # Forwarded ICMP to the world, egress, IPv6; an end the directory does not know.
    icmp = flow(src_ip="fd00::5", dst_ip="2001:db8::1", protocol=58, icmp_type=128, tcp_flags=0)
    icmp.type, icmp.verdict = dp.FLOW_TYPE_POLICY_VERDICT, dp.FLOW_VERDICT_FORWARDED
    icmp.drop_reason, icmp.direction = 0, dp.FLOW_DIRECTION_EGRESS
    icmp.src_identity, icmp.dst_identity, icmp.endpoint_id = 999, 2, 12
    echo = flows.to_hubble(icmp, DIRECTORY)
    VALIDATOR.validate(echo)
    f = echo["flow"]
    assert {"drop_reason", "drop_reason_desc"}.isdisjoint(f)
    assert f["l4"] == {"ICMPv6": {"type": 128}}
    assert f["Summary"] == "ICMPv6 EchoRequest"
    assert f["source"] == {"ID": 12, "identity": 999}
    assert f["destination"] == {"identity": 2, "labels": ["reserved:world"]}
    assert f["event_type"] == {"type": 9}
    # The host endpoint (2^64-1) has no Cilium endpoint id; UDP; an L4 denial
    # is Cilium's POLICY_DENIED with flagella's number kept.
    udp = flows.to_hubble(
        flow(
            protocol=17,
            tcp_flags=0,
            endpoint_id=2**64 - 1,
            drop_reason=230,
            dst_ip="192.168.1.1",
            dst_identity=1,
        ),
        DIRECTORY,
    )
    VALIDATOR.validate(udp)
    assert udp["flow"]["l4"] == {"UDP": {"source_port": 40000, "destination_port": 5432}}
    assert udp["flow"]["destination"] == {"identity": 1, "labels": ["reserved:host"]}
    assert (udp["flow"]["drop_reason"], udp["flow"]["drop_reason_desc"]) == (230, "POLICY_DENIED")
    # The schema is strict: a field hubble does not have fails.
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate({**udp, "flow": {**udp["flow"], "pod": "x"}})


def test_an_audit_verdict_names_the_rules_that_deny() -> None:
    audit = flow()
    audit.denied_by.extend(["shop/db-policy", "cluster-wide"])
    audit.type, audit.verdict = dp.FLOW_TYPE_POLICY_VERDICT, dp.FLOW_VERDICT_AUDIT
    line = flows.to_hubble(audit, DIRECTORY)
    VALIDATOR.validate(line)
    f = line["flow"]
    assert f["verdict"] == "AUDIT"
    assert f["event_type"] == {"type": 9}
    assert f["ingress_denied_by"] == [
        {"name": "db-policy", "namespace": "shop"},
        {"name": "cluster-wide"},
    ]
    assert "egress_denied_by" not in f
    # A policy drop names them the same way, in its direction.
    egress = flow(direction=dp.FLOW_DIRECTION_EGRESS)
    egress.denied_by.append("shop/db-policy")
    dropped = flows.to_hubble(egress, DIRECTORY)
    VALIDATOR.validate(dropped)
    assert dropped["flow"]["egress_denied_by"] == [{"name": "db-policy", "namespace": "shop"}]


def test_every_drop_reason_has_a_cilium_name() -> None:
    names = set(SCHEMA["$defs"]["Flow"]["properties"]["drop_reason_desc"]["enum"])
    for value in dp.DropReason.values():
        assert flows.DROP_REASON_DESC[value] in names
        if value < 230 and value:  # Cilium's numbers: the name is Cilium's for that number
            assert flows.DROP_REASON_DESC[value] != "DROP_REASON_UNKNOWN"
    assert flows.drop_reasons("POLICY_DENIED") == [133, 230]
    assert flows.drop_reasons("policy-deny") == [181]
    assert flows.drop_reasons("policy_l4") == [230]
    assert flows.drop_reasons("133") == [133]
    with pytest.raises(ValueError, match="unknown drop reason 'NOPE'"):
        flows.drop_reasons("NOPE")


def test_filters_on_one_end() -> None:
    line = flows.to_hubble(flow(), DIRECTORY)
    assert flows.EndFilter().matches(line)
    assert flows.EndFilter(pods=("shop/db",)).matches(line)
    assert flows.EndFilter(pods=("other",)).matches(line)  # a prefix, any namespace
    assert flows.EndFilter(pods=("shop/",)).matches(line)
    assert not flows.EndFilter(pods=("kube-system/db",)).matches(line)
    assert flows.EndFilter(namespaces=("shop",)).matches(line)
    assert not flows.EndFilter(namespaces=("default",)).matches(line)
    assert flows.EndFilter(identities=frozenset({301})).matches(line)
    # All of an end's filters hold on the same end (as hubble's).
    assert not flows.EndFilter(pods=("shop/db",), identities=frozenset({300})).matches(line)
    sel = flows.Selector.parse
    assert flows.EndFilter(labels=(sel("app=db,k8s:tier=data"),)).matches(line)
    assert flows.EndFilter(labels=(sel("app=other,!tier"),)).matches(line)
    assert not flows.EndFilter(labels=(sel("app=db,tier!=data"),)).matches(line)
    assert not flows.EndFilter(labels=(sel("app=web"),)).matches(line)
    assert flows.EndFilter(nodes=("n*",)).matches(line)
    assert not flows.EndFilter(nodes=("n1",)).matches(line)
    for bad in ("", ",", "=x", "!"):
        with pytest.raises(ValueError, match="invalid label selector"):
            sel(bad)
    # Unknown ends: a pod filter never matches them.
    assert not flows.EndFilter(pods=("",)).matches(flows.to_hubble(flow(), flows.Directory()))


def test_knows_and_since() -> None:
    assert DIRECTORY.knows(flow())
    assert not DIRECTORY.knows(flow(src_ip="10.0.0.9"))  # a pod's identity, no pod: new
    assert DIRECTORY.knows(flow(dst_identity=2, dst_ip="1.1.1.1"))
    assert not DIRECTORY.knows(flow(dst_identity=77))
    assert parse_since("1h30m", 10_000.0) == 10_000.0 - 5400
    assert parse_since("45s", 100.0) == 55.0
    assert parse_since("2025-11-24T16:00:00Z", 0) == 1_764_000_000.0
    for bad in ("", "5x", "yesterday"):
        with pytest.raises(CliError, match="--since"):
            parse_since(bad, 0)


def test_the_nodes_part_of_the_filters() -> None:
    args = argparse.Namespace(
        verdict=["DROPPED"],
        drop_reason=["POLICY_DENIED", "181"],
        traffic_direction=["INGRESS"],
        identity=[301],
        port=5432,
        protocol="TCP",
        since="30s",
        last=5,
    )
    req = observe_request(args, 1000.0)
    assert list(req.verdicts) == [dp.FLOW_VERDICT_DROPPED]
    assert list(req.drop_reasons) == [133, 230, 181]
    assert list(req.directions) == [dp.FLOW_DIRECTION_INGRESS]
    assert (list(req.identities), req.port, req.protocol) == ([301], 5432, 6)
    assert req.since.ToNanoseconds() == 970 * 10**9
    for field, value, message in (
        ("protocol", "gre", "--protocol 'gre': one of"),
        ("port", 70000, "--port 70000: not a port"),
        ("last", -1, "--last -1: not a count"),
        ("drop_reason", ["NOPE"], "--drop-reason: unknown drop reason 'NOPE'"),
    ):
        with pytest.raises(CliError, match=re.escape(message)):
            observe_request(argparse.Namespace(**{**vars(args), field: value}), 0)


def test_the_directory_of_the_services_answers_names_pods_labels_and_a_frontend() -> None:
    """directory() of ListEndpoints, ListIdentities and ListServices; a flow
    still addressed to a service's frontend names it, as hubble's
    destination_service (valid against the schema); any other does not."""
    eps = [
        endpoint_pb2.Endpoint(
            id=7, pod_name="db-0", pod_namespace="shop", node="n2", addresses=["10.0.0.6/32"]
        ),
        endpoint_pb2.Endpoint(id=8, addresses=["10.0.0.9/32"]),  # no pod: left out
    ]
    ids = [
        policy_pb2.Identity(
            id=301,
            labels=[
                policy_pb2.Label(source="k8s", key="app", value="db"),
                policy_pb2.Label(source="reserved", key="world"),
            ],
        )
    ]
    svcs = [
        lb_pb2.Service(name="shop/web", frontend=lb_pb2.Frontend(address="10.96.7.7", port=80)),
        lb_pb2.Service(
            name="api", namespace="prod", frontend=lb_pb2.Frontend(address="10.96.7.8", port=443)
        ),
    ]
    d = flows.directory(eps, ids, svcs)
    assert d.pods == {"10.0.0.6": flows.Pod("db-0", "shop", 7, "n2")}
    assert d.labels == {301: ("k8s:app=db", "reserved:world")}
    assert d.services == {("10.96.7.7", 80): ("shop", "web"), ("10.96.7.8", 443): ("prod", "api")}
    to_web = flows.to_hubble(
        flow(dst_ip="10.96.7.7", dst_port=80, drop_reason=dp.DROP_REASON_NO_BACKEND), d
    )
    VALIDATOR.validate(to_web)
    assert to_web["flow"]["destination_service"] == {"namespace": "shop", "name": "web"}
    assert to_web["flow"]["drop_reason_desc"] == "SERVICE_BACKEND_NOT_FOUND"
    assert "destination_service" not in flows.to_hubble(flow(dst_port=80), d)["flow"]


def test_the_dns_proxys_flows_as_hubbles_l7_dns_records() -> None:
    refused = flow(
        type=dp.FLOW_TYPE_L7,
        drop_reason=0,
        direction=dp.FLOW_DIRECTION_EGRESS,
        dst_port=53,
        protocol=17,
        tcp_flags=0,
        dns=dp.DNSRecord(query="api.example.test", rcode=5, qtypes=["A"]),
    )
    line = flows.to_hubble(refused, DIRECTORY)
    VALIDATOR.validate(line)
    f = line["flow"]
    assert (f["Type"], f["verdict"], f["event_type"]) == ("L7", "DROPPED", {"type": 129})
    assert f["l7"] == {
        "type": "REQUEST",
        "dns": {"query": "api.example.test.", "rcode": 5, "qtypes": ["A"]},
    }
    answered = flow(
        type=dp.FLOW_TYPE_L7,
        verdict=dp.FLOW_VERDICT_FORWARDED,
        drop_reason=0,
        direction=dp.FLOW_DIRECTION_EGRESS,
        dst_port=53,
        protocol=17,
        tcp_flags=0,
        dns=dp.DNSRecord(query="api.example.test", ips=["192.0.2.1"], ttl=60, qtypes=["A"]),
    )
    line = flows.to_hubble(answered, DIRECTORY)
    VALIDATOR.validate(line)
    assert line["flow"]["l7"] == {
        "type": "RESPONSE",
        "dns": {"query": "api.example.test.", "ips": ["192.0.2.1"], "ttl": 60, "qtypes": ["A"]},
    }
    assert line["flow"]["Summary"] == "DNS Answer api.example.test. A rcode 0"
