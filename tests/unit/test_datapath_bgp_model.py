"""The pure logic of the node's BGP speaker (flagella.datapath.bgp.model):
which policies apply to a node, what each neighbour is sent (pod CIDRs,
service addresses from nodes that may serve them, its own family only),
what cannot be merged (reported, the rest applied), selectors, and the
streams' decoding; GoBGP path messages encoded and decoded (gobgp)."""

from __future__ import annotations

from flagella.api.gobgp.v3 import gobgp_pb2 as g
from flagella.api.lb.v1 import lb_pb2
from flagella.datapath.bgp.gobgp import _decode_path, export_policy_name, path_message
from flagella.datapath.bgp.model import (
    AdvertisedService,
    Neighbor,
    NodeInfo,
    PeeringPolicy,
    Requirement,
    Selector,
    VirtualRouter,
    desired,
    policy_from_proto,
    service_from_proto,
)

NODE = NodeInfo(
    name="n1",
    labels=(("bgp", "yes"), ("rack", "r1")),
    ipv4="192.168.100.1",
    ipv6="fd00:100::1",
    pod_cidrs=("10.200.1.0/24", "fd00:10:200::100/120"),
)


def neighbor(address: str, asn: int = 64512) -> Neighbor:
    return Neighbor(address, asn, 179, 90, 30, 120, 1)


ADVERTISED = Selector((("advertise", "bgp"),))


def router(
    asn: int = 65001,
    *,
    pods: bool = True,
    services: Selector | None = ADVERTISED,
    neighbors: tuple[Neighbor, ...] = (neighbor("192.168.100.253"), neighbor("fd00:100::253")),
    router_id: str = "",
) -> VirtualRouter:
    return VirtualRouter(asn, pods, services, neighbors, router_id)


def svc(
    name: str,
    address: str,
    *,
    local: bool = False,
    nodes: tuple[str, ...] = ("n2",),
    labels: dict[str, str] | None = None,
) -> AdvertisedService:
    return AdvertisedService(
        name=name,
        namespace=name.partition("/")[0],
        labels=tuple(sorted((labels if labels is not None else {"advertise": "bgp"}).items())),
        addresses=(address,),
        local_traffic=local,
        backend_nodes=frozenset(nodes),
    )


def test_selectors_as_kubernetes() -> None:
    labels = {"a": "1", "b": "2"}
    assert Selector().matches(labels)
    assert Selector((("a", "1"),)).matches(labels)
    assert not Selector((("a", "2"),)).matches(labels)
    assert Selector((), (Requirement("a", "In", ("1", "3")),)).matches(labels)
    assert not Selector((), (Requirement("c", "In", ("1",)),)).matches(labels)
    assert Selector((), (Requirement("c", "NotIn", ("1",)),)).matches(labels)
    assert not Selector((), (Requirement("a", "NotIn", ("1",)),)).matches(labels)
    assert Selector((), (Requirement("b", "Exists"),)).matches(labels)
    assert Selector((), (Requirement("c", "DoesNotExist"),)).matches(labels)
    assert not Selector((), (Requirement("a", "Near"),)).matches(labels)


def test_no_policy_selecting_the_node_means_no_speaker() -> None:
    other = PeeringPolicy("p", Selector((("rack", "r2"),)), (router(),))
    assert desired(NODE, [other], [], 179) is None
    assert desired(NODE, [], [], 179) is None


def test_pod_cidrs_and_services_each_to_its_family() -> None:
    p = PeeringPolicy("p", Selector((("bgp", "yes"),)), (router(),))
    services = [
        svc("apps/cluster", "198.51.100.1"),
        svc("apps/v6", "2001:db8::1"),
        svc("apps/local-here", "198.51.100.2", local=True, nodes=("n1",)),
        svc("apps/local-elsewhere", "198.51.100.3", local=True, nodes=("n2",)),
        svc("apps/unselected", "198.51.100.4", labels={"advertise": "no"}),
    ]
    want = desired(NODE, [p], services, 179)
    assert want is not None
    assert (want.asn, want.router_id, want.policies) == (65001, "192.168.100.1", ("p",))
    assert want.listen_addresses == ("192.168.100.1", "fd00:100::1")
    assert want.exports["192.168.100.253"] == {
        "10.200.1.0/24",
        "198.51.100.1/32",
        "198.51.100.2/32",
    }
    assert want.exports["fd00:100::253"] == {"fd00:10:200::100/120", "2001:db8::1/128"}
    assert want.paths["10.200.1.0/24"] == "192.168.100.1"
    assert want.paths["2001:db8::1/128"] == "fd00:100::1"
    assert "198.51.100.3/32" not in want.paths
    assert not want.not_applied


def test_a_local_service_follows_its_backends() -> None:
    p = PeeringPolicy("p", None, (router(pods=False),))
    here = desired(NODE, [p], [svc("a/s", "198.51.100.9", local=True, nodes=("n1",))], 179)
    gone = desired(NODE, [p], [svc("a/s", "198.51.100.9", local=True, nodes=("n3",))], 179)
    assert here is not None
    assert gone is not None
    assert here.exports["192.168.100.253"] == {"198.51.100.9/32"}
    assert gone.exports["192.168.100.253"] == frozenset()


def test_the_namespace_and_name_labels_select_services() -> None:
    by_ns = router(services=Selector((("io.kubernetes.service.namespace", "apps"),)))
    by_name = router(services=Selector((("io.kubernetes.service.name", "web"),)))
    services = [svc("apps/web:http", "198.51.100.1"), svc("other/db", "198.51.100.2")]
    for vr, want in ((by_ns, "198.51.100.1/32"), (by_name, "198.51.100.1/32")):
        got = desired(NODE, [PeeringPolicy("p", None, (vr,))], services, 179)
        assert got is not None
        assert got.exports["192.168.100.253"] == {"10.200.1.0/24", want}


def test_no_service_selector_advertises_no_service() -> None:
    p = PeeringPolicy("p", None, (router(services=None),))
    got = desired(NODE, [p], [svc("a/s", "198.51.100.1")], 179)
    assert got is not None
    assert got.exports["192.168.100.253"] == {"10.200.1.0/24"}


def test_conflicts_are_reported_and_the_rest_applied() -> None:
    first = PeeringPolicy("a", None, (router(65001),))
    clash_asn = PeeringPolicy("b", None, (router(65001), router(65002, neighbors=())))
    clash_rid = PeeringPolicy("c", None, (router(65003, router_id="10.9.9.9"),))
    clash_peer = PeeringPolicy(
        "d", None, (router(65004, neighbors=(neighbor("192.168.100.253"),)),)
    )
    got = desired(NODE, [clash_peer, clash_rid, clash_asn, first], [], 179)
    assert got is not None
    assert (got.asn, got.policies) == (65001, ("a", "b", "d"))
    text = "\n".join(got.not_applied)
    assert "policy b virtual router 0 (ASN 65001): ASN already used by policy a" in text
    assert "policy c virtual router 0 (ASN 65003): router id 10.9.9.9 differs" in text
    assert "neighbor 192.168.100.253 is already a neighbor of policy a" in text
    # The second virtual router of b applies: its own local ASN.
    assert got.peers["192.168.100.253"].local_asn == 65001


def test_a_node_without_an_address_of_the_family() -> None:
    v4_only = NodeInfo("n1", (), "192.168.100.1", "", ("10.200.1.0/24",))
    got = desired(v4_only, [PeeringPolicy("p", None, (router(),))], [], 179)
    assert got is not None
    assert set(got.peers) == {"192.168.100.253"}
    assert any("has no IPv6 address" in w for w in got.not_applied)
    no_v4 = NodeInfo("n1", (), "", "fd00:100::1", ())
    got = desired(no_v4, [PeeringPolicy("p", None, (router(),))], [], 179)
    assert got is not None
    assert got.asn == 0
    assert any("no router id" in w for w in got.not_applied)


def test_peer_fingerprints_change_with_the_password() -> None:
    p = PeeringPolicy("p", None, (router(),))
    with_pw = PeeringPolicy(
        "p",
        None,
        (router(neighbors=(Neighbor("192.168.100.253", 64512, 179, 90, 30, 120, 1, "pw"),)),),
    )
    a = desired(NODE, [p], [], 179)
    b = desired(NODE, [with_pw], [], 179)
    assert a is not None
    assert b is not None
    fa = a.peers["192.168.100.253"].fingerprint()
    fb = b.peers["192.168.100.253"].fingerprint()
    assert fa != fb
    assert "pw" not in repr(b.peers["192.168.100.253"])


def test_streams_decode() -> None:
    msg = lb_pb2.BgpPeeringPolicy(name="p")
    vr = msg.virtual_routers.add(local_asn=65001, export_pod_cidr=True)
    vr.neighbors.add(peer_address="10.0.0.1", peer_asn=64512, password="pw")
    decoded = policy_from_proto(msg)
    assert decoded.node_selector is None
    assert decoded.virtual_routers[0].service_selector is None
    n = decoded.virtual_routers[0].neighbors[0]
    assert (n.peer_port, n.hold_time, n.keep_alive, n.password) == (179, 90, 30, "pw")
    service = lb_pb2.Service(
        name="apps/web:http",
        labels={"advertise": "bgp"},
        external_traffic_policy=lb_pb2.TRAFFIC_POLICY_LOCAL,
        external_ips=["203.0.113.5"],
        backends=[
            lb_pb2.Backend(address="10.200.1.5", node="n1"),
            lb_pb2.Backend(address="10.200.2.5", node="n2", state=lb_pb2.BACKEND_STATE_TERMINATING),
        ],
    )
    service.load_balancer.ingress.append("198.51.100.1")
    got = service_from_proto(service)
    assert got is not None
    assert got.namespace == "apps"
    assert got.addresses == ("198.51.100.1", "203.0.113.5")
    assert got.local_traffic
    assert got.backend_nodes == {"n1"}  # a terminating backend serves no new connection
    assert service_from_proto(lb_pb2.Service(name="apps/plain")) is None


def test_gobgp_paths_round_trip() -> None:
    for prefix, hop in (("10.200.1.0/24", "192.168.100.1"), ("fd00::/120", "fd00:100::1")):
        path = path_message(prefix, hop)
        assert _decode_path(path)[:2] == (prefix, hop)
    assert path_message("fd00::/120", "fd00:100::1").family.afi == g.Family.AFI_IP6
    a = export_policy_name("10.0.0.1", ["b", "a"])
    assert a == export_policy_name("10.0.0.1", ["a", "b"])
    assert a != export_policy_name("10.0.0.1", ["a"])
