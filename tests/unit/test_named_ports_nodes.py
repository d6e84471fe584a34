"""Named ports where the pods are: the CNI arguments and the Kubernetes Pod
spec (the endpoint service), and their resolution in the datapath (a
pod's own ports for ingress, the peers' from the ipcache for egress)."""

from __future__ import annotations

import json

import pytest

from flagella.cni import CniError
from flagella.common.portnames import NamedPort
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.policy import PolicyEntry, expand
from flagella.datapath.namedports import IPCacheValue, PeerPorts, egress_peers, resolve
from flagella.endpoint import cni as spec
from flagella.endpoint.labels import decode_pod

TCP, UDP, SCTP = 6, 17, 132
CONF = {
    "cniVersion": "1.1.0",
    "name": "flagella",
    "type": "flagella-cni",
    "socket": "/run/flagella/cni.sock",
}


def _netconf(named: object) -> spec.NetConf:
    conf = {**CONF, "args": {"cni": {"namedPorts": named}}}
    return spec.parse_netconf(json.dumps(conf).encode(), "ADD")


def test_cni_args_named_ports() -> None:
    conf = _netconf(
        [
            {"name": "http", "port": 8080},
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "assoc", "port": 9000, "protocol": "sctp"},
        ]
    )
    assert conf.named_ports == (
        NamedPort("assoc", 9000, SCTP),
        NamedPort("dns", 53, UDP),
        NamedPort("http", 8080, TCP),
    )
    assert _netconf([]).named_ports == ()


@pytest.mark.parametrize(
    ("named", "message"),
    [
        ({"name": "http"}, "args.cni.namedPorts must be a list"),
        (["http"], "args.cni.namedPorts[0] must be an object"),
        ([{"name": "Http", "port": 80}], "args.cni.namedPorts[0].name: "),
        ([{"name": "a--b", "port": 80}], "args.cni.namedPorts[0].name: "),
        ([{"name": "80", "port": 80}], "at least one letter"),
        ([{"name": "sixteen-chars-xx", "port": 80}], "longer than 15"),
        ([{"name": "http", "port": 80}, {"name": "http", "port": 81}], "[1].name: "),
        ([{"name": "http", "port": 0}], "args.cni.namedPorts[0].port: "),
        ([{"name": "http", "port": 70000}], "args.cni.namedPorts[0].port: "),
        ([{"name": "http", "port": "80"}], "args.cni.namedPorts[0].port must be a number"),
        ([{"name": "http", "port": 80, "protocol": "ICMP"}], "[0].protocol: "),
        ([{"name": "http", "port": 80, "extra": 1}], "[0].extra: unknown field"),
    ],
)
def test_cni_args_named_port_errors_name_the_field(named: object, message: str) -> None:
    with pytest.raises(CniError) as info:
        _netconf(named)
    assert message in str(info.value)
    assert "network config: args.cni.namedPorts" in str(info.value)


def test_pod_spec_named_ports() -> None:
    pod = decode_pod(
        {
            "metadata": {"name": "p", "namespace": "x"},
            "spec": {
                "containers": [
                    {
                        "name": "a",
                        "ports": [
                            {"name": "serve-80-tcp", "containerPort": 80},
                            {"containerPort": 81},
                            {"name": "serve-81-udp", "containerPort": 81, "protocol": "UDP"},
                        ],
                    },
                    {"name": "b", "ports": [{"name": "serve-82-sctp", "containerPort": 82,
                                             "protocol": "SCTP"}]},
                    {"name": "c"},
                ]
            },
        }
    )  # fmt: skip
    assert pod is not None
    assert pod.named_ports == (
        NamedPort("serve-80-tcp", 80, TCP),
        NamedPort("serve-81-udp", 81, UDP),
        NamedPort("serve-82-sctp", 82, SCTP),
    )


def _e(ident: int, name: str, direction: L.Direction, verdict: L.Verdict = L.Verdict.ALLOW,
       proto: int = TCP) -> PolicyEntry:  # fmt: skip
    return PolicyEntry(identity=ident, direction=direction, verdict=verdict, protocol=proto,
                       port_name=name)  # fmt: skip


def test_resolve_ingress_against_the_endpoints_own_ports() -> None:
    entries = (
        _e(300, "http", L.Direction.INGRESS),
        _e(300, "dns", L.Direction.INGRESS, proto=UDP),
        _e(300, "missing", L.Direction.INGRESS),
        PolicyEntry(identity=301, direction=L.Direction.INGRESS, protocol=TCP, port=22),
    )
    own = [NamedPort("http", 8080, TCP), NamedPort("dns", 53, TCP)]
    got = resolve(entries, own, PeerPorts(lambda _: None))
    assert [(e.identity, e.port, e.protocol, e.port_name) for e in got] == [
        (300, 8080, TCP, ""),
        (301, 22, TCP, ""),
    ]  # dns is TCP on this pod, the rule wants UDP; missing names nothing


def test_peer_ports_follow_the_ipcache_and_resolve_egress() -> None:
    changed: list[set[int]] = []
    peers = PeerPorts(changed.append)
    peers.replace_all(
        {
            "10.0.0.1/32": IPCacheValue(400, (NamedPort("web", 80, TCP),)),
            "10.0.0.2/32": IPCacheValue(400, (NamedPort("web", 8080, TCP),)),
            "10.0.0.3/32": IPCacheValue(500, (NamedPort("web", 9090, TCP),)),
            "10.0.1.0/24": IPCacheValue(2),
        }
    )
    assert changed == [{400, 500}]
    entries = (_e(400, "web", L.Direction.EGRESS), _e(0, "web", L.Direction.EGRESS))
    assert egress_peers(entries) == {0, 400}
    got = resolve(entries, [], peers)
    assert [(e.identity, e.port) for e in got] == [(400, 80), (400, 8080), (0, 80), (0, 8080),
                                                   (0, 9090)]  # fmt: skip
    # One pod of 400 changes its number: only 400 changed.
    peers.upsert("10.0.0.2/32", IPCacheValue(400, (NamedPort("web", 8081, TCP),)))
    assert changed[-1] == {400}
    assert peers.ports(400, "web", TCP) == {80, 8081}
    # The same value again changes nothing.
    n = len(changed)
    peers.upsert("10.0.0.2/32", IPCacheValue(400, (NamedPort("web", 8081, TCP),)))
    assert len(changed) == n
    peers.delete("10.0.0.1/32")
    assert peers.ports(400, "web", TCP) == {8081}
    assert peers.ports(400, "web", UDP) == set()


def test_deny_over_allow_after_resolution() -> None:
    # Allow any peer on the name, deny peer 300 on it: the map denies 300.
    entries = (
        _e(0, "http", L.Direction.INGRESS),
        _e(300, "http", L.Direction.INGRESS, L.Verdict.DENY),
    )
    keys = expand(resolve(entries, [NamedPort("http", 8080, TCP)], PeerPorts(lambda _: None)))
    full = L.POLICY_PREFIX_PROTO + 16
    assert keys[(300, int(L.Direction.INGRESS), TCP, 8080, full)][0] == L.Verdict.DENY
    assert keys[(0, int(L.Direction.INGRESS), TCP, 8080, full)][0] == L.Verdict.ALLOW


def test_an_unresolved_name_never_reaches_the_map() -> None:
    with pytest.raises(ValueError, match="named port not resolved"):
        expand([_e(0, "http", L.Direction.INGRESS)])
