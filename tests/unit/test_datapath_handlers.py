"""What the datapath programs for an lb.v1.Service (handlers.bpf_service)."""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration

from flagella.api.lb.v1 import lb_pb2
from flagella.datapath.bpf import frontend_rev_nat_id
from flagella.datapath.handlers import bpf_service


def nodeport_service(address: str = "10.96.0.7") -> lb_pb2.Service:
    return lb_pb2.Service(
        id=12,
        rev_nat_id=34,
        name="default/web",
        frontend=lb_pb2.Frontend(address=address, port=80, protocol=lb_pb2.PROTOCOL_TCP),
        type=lb_pb2.SERVICE_TYPE_NODE_PORT,
        node_port=30007,
        backends=[
            lb_pb2.Backend(id=1, address="10.200.0.5", port=8080),
            lb_pb2.Backend(
                id=2, address="10.200.0.6", port=8080, state=lb_pb2.BACKEND_STATE_TERMINATING
            ),
        ],
        session_affinity=lb_pb2.SessionAffinity(
            type=lb_pb2.SessionAffinity.TYPE_CLIENT_IP, timeout=Duration(seconds=0)
        ),
        source_ranges=["198.51.100.0/24"],
    )


def test_nodeport_frontends_per_node_address_of_the_service_family() -> None:
    svc = bpf_service(nodeport_service(), None, ("192.168.1.1", "fd00:1::1", "192.168.2.1"))
    fronts = [(f.address, f.port, f.rev_nat_id, f.nodeport) for f in svc.frontends]
    # The IPv6 node address gets no frontend for an IPv4 service; the
    # rev-NAT ids stay tied to the address's position.
    assert fronts == [
        ("10.96.0.7", 80, frontend_rev_nat_id(34, 0), False),
        ("192.168.1.1", 30007, frontend_rev_nat_id(34, 1), True),
        ("192.168.2.1", 30007, frontend_rev_nat_id(34, 3), True),
    ]
    assert [(b.id, b.state) for b in svc.backends] == [(1, 1), (2, 2)]
    assert svc.affinity_timeout == 10800  # ClientIP without a timeout: Kubernetes' default
    assert svc.source_ranges == ("198.51.100.0/24",)

    v6 = bpf_service(nodeport_service("fd00:96::7"), None, ("192.168.1.1", "fd00:1::1"))
    assert [f.address for f in v6.frontends] == ["fd00:96::7", "fd00:1::1"]


def test_a_cluster_ip_service_gets_no_node_address() -> None:
    svc = nodeport_service()
    svc.type = lb_pb2.SERVICE_TYPE_CLUSTER_IP
    assert [f.address for f in bpf_service(svc, None, ("192.168.1.1",)).frontends] == ["10.96.0.7"]


def test_loadbalancer_addresses_are_node_port_frontends_at_the_service_port() -> None:
    svc = nodeport_service()
    svc.load_balancer.ingress.extend(["198.51.100.8", "2001:db8::8"])
    fronts = [
        (f.address, f.port, f.rev_nat_id, f.nodeport)
        for f in bpf_service(svc, None, ("192.168.1.1", "fd00:1::1")).frontends
    ]
    # After the node addresses' rev-NAT indexes; the IPv6 one not (no NAT46).
    assert fronts[-1] == ("198.51.100.8", 80, frontend_rev_nat_id(34, 3), True)
    assert len(fronts) == 3
    svc.type = lb_pb2.SERVICE_TYPE_CLUSTER_IP
    assert [f.address for f in bpf_service(svc, None, ()).frontends] == [
        "10.96.0.7",
        "198.51.100.8",
    ]


def test_external_ips_and_local_traffic_policy() -> None:
    """External IPs are node-port frontends after LB-IPAM's two rev-NAT
    indexes; under Local every external frontend (node ports, LoadBalancer
    addresses, external IPs) is local only, the ClusterIP not; a backend is
    this node's when its node is this node's name."""
    svc = nodeport_service()
    svc.backends[0].node = "n1"
    svc.backends[1].node = "n2"
    svc.external_ips.extend(["203.0.113.7", "2001:db8::7"])
    svc.load_balancer.ingress.append("198.51.100.8")
    out = bpf_service(svc, None, ("192.168.1.1",), "n1")
    fronts = [(f.address, f.port, f.rev_nat_id, f.nodeport, f.local_only) for f in out.frontends]
    assert fronts == [
        ("10.96.0.7", 80, frontend_rev_nat_id(34, 0), False, False),
        ("192.168.1.1", 30007, frontend_rev_nat_id(34, 1), True, False),
        ("198.51.100.8", 80, frontend_rev_nat_id(34, 2), True, False),
        ("203.0.113.7", 80, frontend_rev_nat_id(34, 4), True, False),
    ]
    assert [b.local for b in out.backends] == [True, False]
    svc.external_traffic_policy = lb_pb2.TRAFFIC_POLICY_LOCAL
    out = bpf_service(svc, None, ("192.168.1.1",), "n2")
    assert [f.local_only for f in out.frontends] == [False, True, True, True]
    assert [b.local for b in out.backends] == [False, True]
    # No node name: no backend is local (fail closed: dropped, not SNATed).
    assert not any(b.local for b in bpf_service(svc, None, ("192.168.1.1",)).backends)
