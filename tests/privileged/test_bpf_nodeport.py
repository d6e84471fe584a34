"""NodePort from outside the node with BPF_PROG_TEST_RUN: from_netdev
(DNAT on the uplink) to local backends and, with SNAT and the FIB, to
remote ones; to_netdev (reverse NAT of local backends' replies);
conntrack, affinity, terminating backends, Maglev, source ranges and the
backend's ingress policy with the client's identity."""

from __future__ import annotations

import collections

import pytest
from harness.bpf import POD_A, POD_A6, POD_B, POD_B6, POD_C, Pod, inside_netns
from harness.netns import Netns, NetnsSet

from flagella.datapath.bpf import (
    Backend,
    Datapath,
    Direction,
    DropReason,
    Frontend,
    Identity,
    NodeConfig,
    PolicyEntry,
    Service,
    frontend_rev_nat_id,
    maglev_slot,
)
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.bpf.tables import Tuple, monotonic_ns

pytestmark = pytest.mark.privileged

NODE_IP = "192.168.50.1"
NODE_IP6 = "fd00:50::1"
NODE_PORT = 30080
VIP = "10.96.0.20"
VIP6 = "fd00:96::20"
# Outside clients (documentation prefixes): they only ever exist in test runs.
CLIENT = "198.51.100.7"
CLIENT6 = "2001:db8:5::7"
OTHER_CLIENT = "203.0.113.20"
GW_MAC = bytes.fromhex("0a00000050fe")  # the router the client's packets come from
UPLINK_MAC = bytes.fromhex("0a0000005001")
SID = 6
FE_REV_NAT = frontend_rev_nat_id(SID, 1)  # the NodePort frontend's
INGRESS, EGRESS = Direction.INGRESS, Direction.EGRESS


def setup(dp: Datapath, *pods: Pod) -> None:
    dp.config.write(
        NodeConfig(node_ip4=NODE_IP, node_ip6=NODE_IP6, masquerade4=True, masquerade6=True)
    )
    for pod in pods or (POD_A, POD_B, POD_C):
        pod.add(dp)
        dp.policy.apply(pod.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)


def nodeport(
    backends: tuple[Backend, ...],
    *,
    proto: int = 6,
    v6: bool = False,
    **kw: object,
) -> Service:
    return Service(
        service_id=SID,
        frontends=(
            Frontend(VIP6 if v6 else VIP, 80, proto, frontend_rev_nat_id(SID, 0)),
            Frontend(NODE_IP6 if v6 else NODE_IP, NODE_PORT, proto, FE_REV_NAT, nodeport=True),
        ),
        backends=backends,
        **kw,  # type: ignore[arg-type]
    )


def from_outside(
    client: str = CLIENT,
    sport: int = 50000,
    *,
    node: str = NODE_IP,
    dport: int = NODE_PORT,
    proto: int = 6,
    flags: int = P.TCP_SYN,
    payload: bytes = b"flagella",
) -> bytes:
    return P.build(
        client,
        node,
        proto=proto,
        sport=sport,
        dport=dport,
        flags=flags,
        payload=payload,
        src_mac=GW_MAC,
        dst_mac=UPLINK_MAC,
    )


def backend_of(dp: Datapath, frame: bytes) -> str:
    out = dp.test_run("from_netdev", frame)
    assert out.retval == L.TC_ACT_REDIRECT, out.retval
    return P.parse(out.data).dst


def test_dnat_to_a_local_backend_with_correct_checksums(dp: Datapath) -> None:
    setup(dp)
    for proto, sport in ((6, 50001), (17, 50002)):
        dp.upsert_service(nodeport((Backend(7, POD_B.ip, 8080, proto),), proto=proto))
        frame = from_outside(sport=sport, proto=proto, payload=b"y" * 41)
        assert P.parse(frame).l4_csum_ok
        out = dp.test_run("from_netdev", frame)
        assert out.retval == L.TC_ACT_REDIRECT  # straight to B's veth
        pkt = P.parse(out.data)
        # Destination translated, source (the client) kept.
        assert (pkt.src, pkt.sport, pkt.dst, pkt.dport) == (CLIENT, sport, POD_B.ip, 8080)
        assert pkt.l3_csum_ok, "IPv4 header checksum"
        assert pkt.l4_csum_ok, f"L4 checksum of protocol {proto}"
        assert pkt.payload == b"y" * 41
        assert (pkt.dst_mac, pkt.src_mac) == (POD_B.mac_bytes, POD_B.node_mac_bytes)

        front = Tuple(CLIENT, NODE_IP, sport, NODE_PORT, proto)
        svc_ct = dp.conntrack.lookup(front, L.CT_SCOPE_SERVICE)
        assert svc_ct is not None
        assert (svc_ct.backend_id, svc_ct.rev_nat_id) == (7, FE_REV_NAT)
        np_ct = dp.conntrack.lookup(
            Tuple(CLIENT, POD_B.ip, sport, 8080, proto), L.CT_SCOPE_NODEPORT
        )
        assert np_ct is not None
        assert (np_ct.backend_id, np_ct.rev_nat_id) == (7, FE_REV_NAT)
        assert np_ct.identity == Identity.WORLD

        # B's veth: its ingress policy sees the outside client, as world.
        seen = dp.test_run("to_container", out.data)
        assert seen.retval == L.TC_ACT_OK
        ingress = dp.conntrack.lookup(
            Tuple(CLIENT, POD_B.ip, sport, 8080, proto), L.CT_SCOPE_INGRESS
        )
        assert ingress is not None
        assert ingress.identity == Identity.WORLD
        dp.delete_service(SID)


def test_reply_is_reverse_natted_on_the_uplink_not_masqueraded(dp: Datapath) -> None:
    setup(dp)
    dp.upsert_service(nodeport((Backend(7, POD_B.ip, 8080),)))
    out = dp.test_run("from_netdev", from_outside(sport=50100))
    assert dp.test_run("to_container", out.data).retval == L.TC_ACT_OK

    reply = P.build(
        POD_B.ip, CLIENT, sport=8080, dport=50100, flags=P.TCP_SYN | P.TCP_ACK, payload=b"answer"
    )
    up = dp.test_run("from_container", reply)  # at B: a reply, up the host stack
    assert up.retval == L.TC_ACT_OK
    assert up.data == reply
    leaving = dp.test_run("to_netdev", up.data)  # the uplink: back to the frontend
    assert leaving.retval == L.TC_ACT_OK
    pkt = P.parse(leaving.data)
    assert (pkt.src, pkt.sport, pkt.dst, pkt.dport) == (NODE_IP, NODE_PORT, CLIENT, 50100)
    assert pkt.l3_csum_ok
    assert pkt.l4_csum_ok
    assert pkt.payload == b"answer"
    # Not masqueraded (masquerade is on): no NAT entry was made for it.
    assert dp.nat.entries() == []
    entry = dp.conntrack.lookup(Tuple(CLIENT, POD_B.ip, 50100, 8080, 6), L.CT_SCOPE_NODEPORT)
    assert entry is not None
    assert entry.flags & L.CT_F_REPLY_SEEN

    # The next client packet of the connection goes to the same backend
    # with nothing re-balanced; B's other traffic to the outside is still
    # masqueraded.
    again = from_outside(sport=50100, flags=P.TCP_ACK)
    assert backend_of(dp, again) == POD_B.ip
    own = dp.test_run("to_netdev", P.build(POD_B.ip, CLIENT, sport=40000, dport=443))
    assert P.parse(own.data).src == NODE_IP
    assert P.parse(own.data).sport != 40000


def test_ipv6_nodeport(dp: Datapath) -> None:
    setup(dp, POD_A6, POD_B6)
    dp.upsert_service(nodeport((Backend(8, POD_B6.ip, 8443),), v6=True))
    frame = from_outside(CLIENT6, 50200, node=NODE_IP6)
    out = dp.test_run("from_netdev", frame)
    assert out.retval == L.TC_ACT_REDIRECT
    pkt = P.parse(out.data)
    assert (pkt.src, pkt.dst, pkt.dport, pkt.l4_csum_ok) == (CLIENT6, POD_B6.ip, 8443, True)
    assert dp.test_run("to_container", out.data).retval == L.TC_ACT_OK
    reply = P.build(POD_B6.ip, CLIENT6, sport=8443, dport=50200, flags=P.TCP_SYN | P.TCP_ACK)
    back = P.parse(dp.test_run("to_netdev", reply).data)
    assert (back.src, back.sport, back.dst, back.l4_csum_ok) == (NODE_IP6, NODE_PORT, CLIENT6, True)


def test_not_a_nodeport_passes_untouched(dp: Datapath) -> None:
    setup(dp)
    dp.upsert_service(nodeport((Backend(7, POD_B.ip, 8080),)))
    for frame in (
        from_outside(dport=22),  # the node's own service
        from_outside(node="192.168.50.2"),  # not this node's address
        from_outside(node=VIP, dport=80),  # a ClusterIP is not served from outside
        from_outside(proto=1),  # ping of the node
    ):
        out = dp.test_run("from_netdev", frame)
        assert (out.retval, out.data) == (L.TC_ACT_OK, frame)
    assert dp.conntrack.entries() == []


def test_no_backend_drop_with_reason_counter_and_event(dp: Datapath) -> None:
    setup(dp)
    dp.upsert_service(nodeport((Backend(9, POD_B.ip, 8080, state=2),)))  # terminating only
    out = dp.test_run("from_netdev", from_outside(sport=50300))
    assert out.retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.NO_BACKEND, INGRESS) == 1
    with dp.events() as ev:
        drops = [f for f in ev.read() if f.type == L.FlowType.DROP]
    assert [d.drop_reason for d in drops] == [DropReason.NO_BACKEND]
    assert (drops[0].src_ip, drops[0].dst_ip, drops[0].dst_port) == (CLIENT, NODE_IP, NODE_PORT)
    assert drops[0].src_identity == Identity.WORLD
    assert dp.conntrack.entries() == []


def test_source_ranges_are_honoured(dp: Datapath) -> None:
    setup(dp)
    dp.upsert_service(nodeport((Backend(7, POD_B.ip, 8080),), source_ranges=("198.51.100.0/28",)))
    assert backend_of(dp, from_outside(CLIENT, 50400)) == POD_B.ip
    for sport in (50401, 50402):  # every packet, not only the first
        out = dp.test_run("from_netdev", from_outside(OTHER_CLIENT, sport))
        assert out.retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.SOURCE_RANGE, INGRESS) == 2


def test_backend_ingress_policy_sees_the_outside_client_as_world(dp: Datapath) -> None:
    setup(dp, POD_A, POD_C)
    POD_B.add(dp)
    # B admits A only: the outside client (world) is not allowed.
    dp.policy.apply(POD_B.endpoint_id, [PolicyEntry(POD_A.identity, INGRESS, protocol=6)], 1)
    dp.upsert_service(nodeport((Backend(7, POD_B.ip, 8080),)))
    out = dp.test_run("from_netdev", from_outside(sport=50500))
    assert out.retval == L.TC_ACT_REDIRECT
    with dp.events() as ev:
        denied = dp.test_run("to_container", out.data)
        assert denied.retval == L.TC_ACT_SHOT
        drops = [f for f in ev.read() if f.type == L.FlowType.DROP]
    assert [(d.drop_reason, d.src_identity, d.dst_identity) for d in drops] == [
        (DropReason.POLICY_L3, Identity.WORLD, POD_B.identity)
    ]
    # Allowing world on the port lets it in; a CIDR identity of the client's
    # prefix would be used instead once the ipcache has one.
    dp.policy.apply(
        POD_B.endpoint_id,
        [
            PolicyEntry(POD_A.identity, INGRESS, protocol=6),
            PolicyEntry(Identity.WORLD, INGRESS, protocol=6, port=8080),
        ],
        2,
    )
    assert dp.test_run("to_container", out.data).retval == L.TC_ACT_OK
    cidr_id = L.LOCAL_IDENTITY_SCOPE + 5
    dp.ipcache.upsert("198.51.100.0/24", cidr_id)
    out = dp.test_run("from_netdev", from_outside(sport=50501))
    denied = dp.test_run("to_container", out.data)
    assert denied.retval == L.TC_ACT_SHOT
    dp.policy.apply(POD_B.endpoint_id, [PolicyEntry(cidr_id, INGRESS, protocol=6, port=8080)], 3)
    assert dp.test_run("to_container", out.data).retval == L.TC_ACT_OK


def test_terminating_backend_keeps_established_gets_no_new(dp: Datapath) -> None:
    setup(dp)
    dp.upsert_service(nodeport((Backend(7, POD_B.ip, 8080),)))
    assert backend_of(dp, from_outside(sport=50600)) == POD_B.ip
    dp.upsert_service(nodeport((Backend(7, POD_B.ip, 8080, state=2), Backend(8, POD_C.ip, 8080))))
    # The established connection stays on the terminating backend, with
    # its replies still translated ...
    for _ in range(3):
        assert backend_of(dp, from_outside(sport=50600, flags=P.TCP_ACK)) == POD_B.ip
    reply = P.build(POD_B.ip, CLIENT, sport=8080, dport=50600, flags=P.TCP_ACK)
    assert P.parse(dp.test_run("to_netdev", reply).data).src == NODE_IP
    # ... new connections never go there.
    new = {backend_of(dp, from_outside(sport=s)) for s in range(50601, 50641)}
    assert new == {POD_C.ip}
    # Removing the backend purges its connections: re-balanced.
    dp.remove_backends([7])
    assert dp.conntrack.lookup(Tuple(CLIENT, POD_B.ip, 50600, 8080, 6), L.CT_SCOPE_NODEPORT) is None
    assert backend_of(dp, from_outside(sport=50600, flags=P.TCP_ACK)) == POD_C.ip


def age_affinity(dp: Datapath, client: str, seconds: float) -> None:
    k = L.AffinityKey(service_id=SID)
    L.set_addr(k.client, client)
    v = dp.affinity.get(k)
    assert v is not None
    v.last_used -= int(seconds * 10**9)
    dp.affinity.update(k, v)


def test_client_ip_affinity_sticks_until_its_timeout(dp: Datapath) -> None:
    setup(dp)
    backends = (Backend(7, POD_A.ip, 8080), Backend(8, POD_B.ip, 8080), Backend(9, POD_C.ip, 8080))
    dp.upsert_service(nodeport(backends, affinity_timeout=60))
    first = backend_of(dp, from_outside(sport=50700))
    # Every new connection of the client, inside the timeout, sticks.
    for sport in range(50701, 50741):
        assert backend_of(dp, from_outside(sport=sport)) == first
    age_affinity(dp, CLIENT, 59)
    assert backend_of(dp, from_outside(sport=50741)) == first  # refreshed by its use
    age_affinity(dp, CLIENT, 59)
    assert backend_of(dp, from_outside(sport=50742)) == first
    # Other clients are balanced independently.
    others = {backend_of(dp, from_outside(f"198.51.100.{i}", 50743)) for i in range(20, 60)}
    assert len(others) > 1
    # Past the timeout the choice is made again, per new choice: over a few
    # expiries, more than one backend shows up.
    chosen = set()
    for sport in range(50750, 50770):
        age_affinity(dp, CLIENT, 61)
        chosen.add(backend_of(dp, from_outside(sport=sport)))
    assert len(chosen) > 1
    # A terminating backend keeps its connection but not the client.
    current = backend_of(dp, from_outside(sport=50800))
    states = {b.address: (2 if b.address == current else 1) for b in backends}
    dp.upsert_service(
        nodeport(
            tuple(Backend(b.id, b.address, 8080, state=states[b.address]) for b in backends),
            affinity_timeout=60,
        )
    )
    assert backend_of(dp, from_outside(sport=50800, flags=P.TCP_ACK)) == current
    moved = backend_of(dp, from_outside(sport=50801))
    assert moved != current
    assert {backend_of(dp, from_outside(sport=s)) for s in range(50802, 50820)} == {moved}


def test_maglev_selection_on_the_frontend_tuple(dp: Datapath) -> None:
    setup(dp)
    backends = (Backend(7, POD_A.ip, 8080), Backend(8, POD_B.ip, 8080), Backend(9, POD_C.ip, 8080))
    size = 251
    table = tuple(7 + (i * 5 % 3) for i in range(size))
    dp.upsert_service(nodeport(backends, maglev=True, maglev_table=table))
    by_id = {b.id: b.address for b in backends}
    hits: collections.Counter[str] = collections.Counter()
    for sport in range(51000, 51150):
        slot = maglev_slot(CLIENT, NODE_IP, sport, NODE_PORT, 6, size=size)
        got = backend_of(dp, from_outside(sport=sport))
        assert got == by_id[table[slot]], f"sport {sport} slot {slot}"
        hits[got] += 1
    assert len(hits) == 3


# --- remote backends: SNAT to the node address, sent by the FIB ---

REMOTE_BACKEND = "10.250.0.10"
NO_NEIGH_BACKEND = "10.251.0.10"
GATEWAY = "192.168.50.254"
QUIET_GATEWAY = "192.168.50.253"  # no neighbour entry: resolved by the kernel


@pytest.fixture
def uplink(nss: NetnsSet) -> tuple[Netns, int, bytes]:
    """A node netns with an uplink (veth up0, NODE_IP/24), routes to the
    outside and to a remote backend's network via a gateway whose MAC is
    known, forwarding on: (netns, up0's ifindex, up0's MAC)."""
    ns = nss.new("np")
    ns.ip("link", "add", "up0", "type", "veth", "peer", "name", "up0p")
    ns.ip("link", "set", "up0", "address", UPLINK_MAC.hex(":"))
    ns.ip("addr", "add", f"{NODE_IP}/24", "dev", "up0")
    ns.ip("link", "set", "up0", "up")
    ns.ip("link", "set", "up0p", "up")
    ns.ip("neigh", "replace", GATEWAY, "lladdr", GW_MAC.hex(":"), "dev", "up0", "nud", "permanent")
    ns.ip("route", "add", "default", "via", GATEWAY)
    ns.ip("route", "add", "10.251.0.0/24", "via", QUIET_GATEWAY)
    ns.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
    link = ns.link("up0")
    return ns, int(link["ifindex"]), UPLINK_MAC  # type: ignore[call-overload]


def test_remote_backend_is_snatted_and_its_reply_reverse_natted(
    dp: Datapath, uplink: tuple[Netns, int, bytes]
) -> None:
    ns, ifindex, mac = uplink
    setup(dp)
    dp.upsert_service(nodeport((Backend(20, REMOTE_BACKEND, 8080),)))
    with inside_netns(ns.path):
        out = dp.test_run(
            "from_netdev", from_outside(sport=52000, payload=b"z" * 7), ifindex=ifindex
        )
    assert out.retval == L.TC_ACT_REDIRECT  # out of the uplink, via the gateway
    pkt = P.parse(out.data)
    assert (pkt.src, pkt.dst, pkt.dport) == (NODE_IP, REMOTE_BACKEND, 8080)
    nat_port = pkt.sport
    assert 61000 <= nat_port <= 65535
    assert (pkt.l3_csum_ok, pkt.l4_csum_ok, pkt.payload) == (True, True, b"z" * 7)
    assert (pkt.dst_mac, pkt.src_mac) == (GW_MAC, mac)
    entries = {(t.src, t.dst, t.sport, t.dport, d, ip, port) for t, d, ip, port in dp.nat.entries()}
    assert entries == {
        (CLIENT, REMOTE_BACKEND, 52000, 8080, L.NAT_OUT, NODE_IP, nat_port),
        (REMOTE_BACKEND, NODE_IP, 8080, nat_port, L.NAT_IN, CLIENT, 52000),
    }
    assert {row[1]["flags"] for row in dp.dump("snat")} == {"nodeport"}

    # The next packet of the connection: same backend, same NAT port.
    with inside_netns(ns.path):
        again = dp.test_run(
            "from_netdev", from_outside(sport=52000, flags=P.TCP_ACK), ifindex=ifindex
        )
        reply = P.build(
            REMOTE_BACKEND,
            NODE_IP,
            sport=8080,
            dport=nat_port,
            flags=P.TCP_SYN | P.TCP_ACK,
            payload=b"answer",
            src_mac=GW_MAC,
            dst_mac=mac,
        )
        back = dp.test_run("from_netdev", reply, ifindex=ifindex)
    assert P.parse(again.data).sport == nat_port
    assert back.retval == L.TC_ACT_REDIRECT
    r = P.parse(back.data)
    # The client sees the frontend as its peer.
    assert (r.src, r.sport, r.dst, r.dport) == (NODE_IP, NODE_PORT, CLIENT, 52000)
    assert (r.l3_csum_ok, r.l4_csum_ok, r.payload) == (True, True, b"answer")
    assert (r.dst_mac, r.src_mac) == (GW_MAC, mac)
    assert dp.metrics.forwarded(INGRESS) == 3


def test_remote_backend_next_hop_unresolved_or_unroutable(
    dp: Datapath, uplink: tuple[Netns, int, bytes]
) -> None:
    ns, ifindex, _ = uplink
    setup(dp)
    dp.upsert_service(nodeport((Backend(21, NO_NEIGH_BACKEND, 8080),)))
    frame = from_outside(sport=52100)
    with inside_netns(ns.path):
        out = dp.test_run("from_netdev", frame, ifindex=ifindex)
    # Handed to the neighbour subsystem (bpf_redirect_neigh): MACs untouched.
    assert out.retval == L.TC_ACT_REDIRECT
    pkt = P.parse(out.data)
    assert (pkt.src, pkt.dst, pkt.dst_mac) == (NODE_IP, NO_NEIGH_BACKEND, UPLINK_MAC)

    # No route (no IPv6 route at all in this netns): dropped with a reason.
    dp.upsert_service(
        Service(
            7,
            (Frontend(NODE_IP6, NODE_PORT, 6, frontend_rev_nat_id(7, 1), nodeport=True),),
            (Backend(22, "2001:db8:250::10", 8080),),
        )
    )
    with inside_netns(ns.path):
        out = dp.test_run(
            "from_netdev", from_outside(CLIENT6, 52101, node=NODE_IP6), ifindex=ifindex
        )
    assert out.retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.FIB_LOOKUP_FAILED, INGRESS) == 1


def test_local_traffic_policy_balances_over_local_backends_only(dp: Datapath) -> None:
    """externalTrafficPolicy Local on the NodePort frontend: outside clients
    reach the local backends only (never the remote one, so never SNAT),
    a client's affinity to the remote backend (from a pod's connection) is
    not used; without a local backend the packet is dropped (NO_BACKEND);
    pods keep every backend, through the ClusterIP and the node port."""
    setup(dp)
    remote = "10.250.0.9"
    backends = (
        Backend(7, POD_A.ip, 8080, local=True),
        Backend(8, POD_B.ip, 8080, local=True),
        Backend(9, remote, 8080),
    )
    local_np = Frontend(NODE_IP, NODE_PORT, 6, FE_REV_NAT, nodeport=True, local_only=True)
    svc = Service(
        SID,
        (Frontend(VIP, 80, 6, frontend_rev_nat_id(SID, 0)), local_np),
        backends,
    )
    dp.upsert_service(svc)
    chosen = {backend_of(dp, from_outside(f"198.51.100.{i}", 51000)) for i in range(20, 80)}
    assert chosen == {POD_A.ip, POD_B.ip}
    # Pods: every backend (the remote one too), at the ClusterIP and the node port.
    for dst, dport in ((VIP, 80), (NODE_IP, NODE_PORT)):
        seen = set()
        for sport in range(46000, 46060):
            out = dp.test_run("from_container", P.build(POD_C.ip, dst, sport=sport, dport=dport))
            seen.add(P.parse(out.data).dst)
        assert seen == {POD_A.ip, POD_B.ip, remote}, dst

    # Affinity: a client's entry naming the remote backend is not used.
    dp.upsert_service(Service(SID, svc.frontends, backends, affinity_timeout=60))
    k = L.AffinityKey(service_id=SID)
    L.set_addr(k.client, CLIENT)
    dp.affinity.update(k, L.AffinityValue(last_used=monotonic_ns(), backend_id=9))
    first = backend_of(dp, from_outside(sport=51100))
    assert first in (POD_A.ip, POD_B.ip)
    assert {backend_of(dp, from_outside(sport=s)) for s in range(51101, 51120)} == {first}

    # No local backend: dropped, with its reason.
    dp.upsert_service(Service(SID, svc.frontends, (Backend(9, remote, 8080),)))
    out = dp.test_run("from_netdev", from_outside(sport=51200))
    assert out.retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.NO_BACKEND, INGRESS) == 1
