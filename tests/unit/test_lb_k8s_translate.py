"""Kubernetes Services and EndpointSlices to flagella services (pure part)."""

from __future__ import annotations

from harness.kube_api import k8s_endpoint_slice, k8s_service

from flagella.lb.k8s import is_lbipam_service, lb_request, lb_status, slice_service, translate
from flagella.lb.lbipam import SATISFIED, Claimant, Condition, LbRequest
from flagella.lb.lbipam_store import Claim
from flagella.lb.model import (
    Algorithm,
    BackendState,
    Protocol,
    ServiceType,
    Source,
    TrafficPolicy,
)
from flagella.lb.validation import Limits, build_spec

PORTS = [
    {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
]
SLICE_PORTS = [
    {"name": "http", "port": 8080, "protocol": "TCP"},
    {"name": "dns", "port": 5353, "protocol": "UDP"},
]


def ep(addr: str, node: str = "n1", **conditions: bool) -> dict[str, object]:
    return {"addresses": [addr], "nodeName": node, "conditions": conditions}


def test_cluster_ip_service_with_conditions_to_states() -> None:
    svc = k8s_service("shop", "web", "10.96.0.10", PORTS, session_affinity_timeout=60)
    sl = k8s_endpoint_slice(
        "shop",
        "web-abc",
        "web",
        SLICE_PORTS,
        [
            ep("10.0.0.1", ready=True, serving=True, terminating=False),
            ep("10.0.0.2", ready=False, serving=True, terminating=True),
            ep("10.0.0.3", ready=False, serving=False, terminating=True),
            ep("10.0.0.4", ready=False, serving=False, terminating=False),
            ep("10.0.0.5"),  # conditions unknown: read as ready
        ],
    )
    out = {r.name: r for r in translate(svc, [sl], Algorithm.RANDOM)}
    assert set(out) == {"shop/web:http", "shop/web:dns"}
    http = out["shop/web:http"]
    assert (http.frontend_address, http.frontend_port, http.protocol) == (
        "10.96.0.10",
        80,
        Protocol.TCP,
    )
    assert http.type is ServiceType.CLUSTER_IP
    assert http.source is Source.KUBERNETES
    assert http.client_ip_affinity
    assert http.affinity_timeout == (60, 0)
    states = {(b.address, b.port): b.state for b in http.backends}
    assert states == {
        ("10.0.0.1", 8080): BackendState.ACTIVE,
        ("10.0.0.2", 8080): BackendState.TERMINATING,
        ("10.0.0.3", 8080): BackendState.TERMINATING,
        ("10.0.0.5", 8080): BackendState.ACTIVE,
    }
    assert {b.port for b in out["shop/web:dns"].backends} == {5353}
    spec = build_spec(http, Limits())
    assert spec.name == "shop/web:http"
    assert spec.namespace == "shop"


def test_node_port_annotation_ranges_and_dual_stack() -> None:
    svc = k8s_service(
        "default",
        "api",
        "10.96.0.20",
        [{"port": 443, "protocol": "TCP", "nodePort": 30443}],
        type="NodePort",
        annotations={"flagella.io/lb-algorithm": "maglev"},
        source_ranges=["192.0.2.0/24"],
    )
    svc["spec"]["clusterIPs"] = ["10.96.0.20", "fd00::20"]
    v4 = k8s_endpoint_slice(
        "default", "api-1", "api", [{"port": 8443, "protocol": "TCP"}], [ep("10.0.1.1")]
    )
    v6 = k8s_endpoint_slice(
        "default",
        "api-2",
        "api",
        [{"port": 8443, "protocol": "TCP"}],
        [ep("fd00::1:1")],
        address_type="IPv6",
    )
    out = {r.name: r for r in translate(svc, [v4, v6])}
    assert set(out) == {"default/api:443", "default/api:443:ipv6"}
    first = out["default/api:443"]
    assert first.type is ServiceType.NODE_PORT
    assert first.node_port == 30443
    assert first.algorithm is Algorithm.MAGLEV
    assert first.source_ranges == ["192.0.2.0/24"]
    assert [b.address for b in first.backends] == ["10.0.1.1"]
    assert [b.address for b in out["default/api:443:ipv6"].backends] == ["fd00::1:1"]


def test_services_that_are_not_load_balanced() -> None:
    headless = k8s_service("d", "h", "None", PORTS)
    assert translate(headless, []) == []
    external = k8s_service("d", "e", "10.96.0.1", PORTS, type="ExternalName")
    assert translate(external, []) == []
    sctp = k8s_service("d", "s", "10.96.0.1", [{"port": 1, "protocol": "SCTP"}])
    assert translate(sctp, []) == []


def test_slices_of_other_services_and_ports_are_ignored() -> None:
    svc = k8s_service("d", "web", "10.96.0.10", PORTS[:1])
    other = k8s_endpoint_slice("d", "x", "other", SLICE_PORTS, [ep("10.0.0.9")])
    assert slice_service(other) == "d/other"
    wrong_port = k8s_endpoint_slice(
        "d", "y", "web", [{"name": "metrics", "port": 9090}], [ep("10.0.0.8")]
    )
    (only,) = translate(svc, [wrong_port])
    assert only.backends == []


def test_loadbalancer_service_external_ips_and_traffic_policy() -> None:
    svc = k8s_service(
        "shop",
        "web",
        "10.96.0.10",
        [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}],
        type="LoadBalancer",
        annotations={
            "lbipam.cilium.io/ips": "2001:db8::5, 198.51.100.9, nonsense",
            "lbipam.cilium.io/sharing-key": "shared",
        },
    )
    svc["spec"].update(
        externalTrafficPolicy="Local",
        externalIPs=["203.0.113.1", "2001:db8::1"],
        healthCheckNodePort=31999,
    )
    (raw,) = translate(svc, [], Algorithm.RANDOM)
    assert raw.external_traffic_policy is TrafficPolicy.LOCAL
    assert raw.health_check_node_port == 31999
    assert list(raw.external_ips) == ["203.0.113.1"]  # the IPv4 service's
    assert raw.load_balancer
    spec = build_spec(raw, Limits())
    assert spec.external_ips == ("203.0.113.1",)
    assert lb_request(svc, 4) == LbRequest(("198.51.100.9",), "shared", (4,))
    assert lb_request(svc, 6) == LbRequest(("2001:db8::5",), "shared", (6,))
    # spec.loadBalancerIP first; without a sharing key, the Service's own.
    svc["spec"]["loadBalancerIP"] = "198.51.100.7"
    del svc["metadata"]["annotations"]["lbipam.cilium.io/sharing-key"]
    assert lb_request(svc, 4) == LbRequest(("198.51.100.7",), "service:shop/web", (4,))
    # Only unset or Cilium's class is LB-IPAM's; other types are not.
    assert is_lbipam_service(svc)
    svc["spec"]["loadBalancerClass"] = "io.cilium/bgp-control-plane"
    assert is_lbipam_service(svc)
    svc["spec"]["loadBalancerClass"] = "example.com/lb"
    assert not is_lbipam_service(svc)
    assert not translate(svc, [], Algorithm.RANDOM)[0].load_balancer
    svc["spec"]["type"] = "NodePort"
    del svc["spec"]["loadBalancerClass"]
    assert not is_lbipam_service(svc)


def test_status_of_a_service_from_its_claims() -> None:
    def claim(addresses: tuple[str, ...], cond: Condition = SATISFIED) -> Claim:
        who = Claimant("shop/web:http", "shop", {}, frozenset(), LbRequest())
        return Claim(who, addresses, cond)

    both = [claim(("2001:db8::1",)), claim(("198.51.100.1",)), claim(("198.51.100.1",))]
    addresses, cond = lb_status(both)
    assert addresses == ["198.51.100.1", "2001:db8::1"]
    assert cond is not None
    assert (cond["type"], cond["status"], cond["reason"]) == (
        "io.cilium/lb-ipam-request-satisfied",
        "True",
        "satisfied",
    )
    full = Condition(False, "pool_exhausted", "no free IPv4 address in p")
    addresses, cond = lb_status([claim(("198.51.100.1",)), claim((), full)])
    assert cond is not None
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "False",
        "pool_exhausted",
        full.message,
    )
    assert lb_status([None]) == ([], None)
