"""Service load balancing in from_container / to_container with
BPF_PROG_TEST_RUN: DNAT with checksums, reverse NAT, Maglev, affinity,
source ranges, no-backend drops."""

from __future__ import annotations

import collections

import pytest
from harness.bpf import POD_A, POD_A6, POD_B, POD_B6, POD_C, Pod

from flagella.datapath.bpf import (
    Backend,
    Datapath,
    Direction,
    DropReason,
    Frontend,
    PolicyEntry,
    Programs,
    Service,
    frontend_rev_nat_id,
    maglev_slot,
)
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.bpf.tables import Tuple

pytestmark = pytest.mark.privileged

VIP = "10.96.0.10"
VIP6 = "fd00:96::10"
EGRESS, INGRESS = Direction.EGRESS, Direction.INGRESS


def ready(dp: Datapath, *pods: Pod) -> None:
    for pod in pods:
        pod.add(dp)
        dp.policy.apply(pod.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)


def svc(
    backends: tuple[Backend, ...],
    *,
    proto: int = 6,
    vip: str = VIP,
    port: int = 80,
    **kw: object,
) -> Service:
    return Service(
        service_id=5,
        frontends=(Frontend(vip, port, proto, rev_nat_id=frontend_rev_nat_id(5, 0)),),
        backends=backends,
        **kw,  # type: ignore[arg-type]
    )


def test_dnat_to_backend_with_correct_checksums(dp: Datapath) -> None:
    ready(dp, POD_A, POD_B)
    for proto, sport in ((6, 45000), (17, 45001)):
        dp.upsert_service(svc((Backend(7, POD_B.ip, 8080, proto),), proto=proto))
        frame = P.build(POD_A.ip, VIP, proto=proto, sport=sport, dport=80, payload=b"x" * 33)
        assert P.parse(frame).l4_csum_ok
        out = dp.test_run("from_container", frame)
        assert out.retval == L.TC_ACT_REDIRECT
        pkt = P.parse(out.data)
        assert (pkt.src, pkt.sport, pkt.dst, pkt.dport) == (POD_A.ip, sport, POD_B.ip, 8080)
        assert pkt.l3_csum_ok, "IPv4 header checksum"
        assert pkt.l4_csum_ok, f"L4 checksum of protocol {proto}"
        assert pkt.payload == b"x" * 33
        assert pkt.dst_mac == POD_B.mac_bytes
        service_ct = dp.conntrack.lookup(Tuple(POD_A.ip, VIP, sport, 80, proto), L.CT_SCOPE_SERVICE)
        assert service_ct is not None
        assert service_ct.backend_id == 7
        egress_ct = dp.conntrack.lookup(
            Tuple(POD_A.ip, POD_B.ip, sport, 8080, proto), L.CT_SCOPE_EGRESS
        )
        assert egress_ct is not None
        assert egress_ct.rev_nat_id == frontend_rev_nat_id(5, 0)
        dp.delete_service(5)


def test_reverse_nat_of_the_reply(dp: Datapath) -> None:
    ready(dp, POD_A, POD_B)
    dp.upsert_service(svc((Backend(7, POD_B.ip, 8080),)))
    out = dp.test_run("from_container", P.build(POD_A.ip, VIP, sport=45100, dport=80))
    assert out.retval == L.TC_ACT_REDIRECT
    assert dp.test_run("to_container", out.data).retval == L.TC_ACT_OK  # at B

    reply = P.build(POD_B.ip, POD_A.ip, sport=8080, dport=45100, flags=P.TCP_SYN | P.TCP_ACK)
    back = dp.test_run("from_container", reply)  # at B: reply, to A
    assert back.retval == L.TC_ACT_REDIRECT
    seen = dp.test_run("to_container", back.data)  # at A: reverse NAT
    assert seen.retval == L.TC_ACT_OK
    pkt = P.parse(seen.data)
    assert (pkt.src, pkt.sport, pkt.dst, pkt.dport) == (VIP, 80, POD_A.ip, 45100)
    assert pkt.l3_csum_ok
    assert pkt.l4_csum_ok


def test_ipv6_dnat_and_reverse_nat(dp: Datapath) -> None:
    ready(dp, POD_A6, POD_B6)
    dp.upsert_service(svc((Backend(8, POD_B6.ip, 8443),), vip=VIP6, port=443))
    out = dp.test_run("from_container", P.build(POD_A6.ip, VIP6, sport=45200, dport=443))
    assert out.retval == L.TC_ACT_REDIRECT
    pkt = P.parse(out.data)
    assert (pkt.dst, pkt.dport, pkt.l4_csum_ok) == (POD_B6.ip, 8443, True)
    reply = P.build(POD_B6.ip, POD_A6.ip, sport=8443, dport=45200, flags=P.TCP_ACK)
    seen = dp.test_run("to_container", reply)
    assert seen.retval == L.TC_ACT_OK
    pkt = P.parse(seen.data)
    assert (pkt.src, pkt.sport, pkt.l4_csum_ok) == (VIP6, 443, True)


def test_no_backend_drop_with_reason_and_counter(dp: Datapath) -> None:
    ready(dp, POD_A)
    # The only backend is terminating: no new connections go to it.
    dp.upsert_service(svc((Backend(9, POD_B.ip, 8080, state=2),)))
    before = dp.metrics.drops(DropReason.NO_BACKEND, EGRESS)
    out = dp.test_run("from_container", P.build(POD_A.ip, VIP, dport=80))
    assert out.retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.NO_BACKEND, EGRESS) == before + 1
    with dp.events() as ev:
        drops = [f for f in ev.read() if f.type == L.FlowType.DROP]
    assert [d.drop_reason for d in drops] == [DropReason.NO_BACKEND]
    assert drops[0].dst_ip == VIP
    assert drops[0].endpoint_id == POD_A.endpoint_id


def test_terminating_backend_keeps_its_connections(dp: Datapath) -> None:
    ready(dp, POD_A, POD_B, POD_C)
    dp.upsert_service(svc((Backend(7, POD_B.ip, 8080),)))
    first = P.build(POD_A.ip, VIP, sport=45300, dport=80)
    assert P.parse(dp.test_run("from_container", first).data).dst == POD_B.ip
    dp.upsert_service(svc((Backend(7, POD_B.ip, 8080, state=2), Backend(8, POD_C.ip, 8080))))
    again = P.build(POD_A.ip, VIP, sport=45300, dport=80, flags=P.TCP_ACK)
    assert P.parse(dp.test_run("from_container", again).data).dst == POD_B.ip
    new = P.build(POD_A.ip, VIP, sport=45301, dport=80)
    assert P.parse(dp.test_run("from_container", new).data).dst == POD_C.ip

    # Removing the backend purges its service entries: the next packet of
    # the old connection is balanced again.
    assert dp.remove_backends([7]) == 1
    assert P.parse(dp.test_run("from_container", again).data).dst == POD_C.ip


def test_maglev_slot_selection(dp: Datapath) -> None:
    ready(dp, POD_A)
    backends = tuple(Backend(100 + i, f"10.1.1.{i + 1}", 8080) for i in range(4))
    size = 251
    table = tuple(100 + (i * 7 % 4) for i in range(size))
    dp.upsert_service(svc(backends, maglev=True, maglev_table=table))
    assert dp.maglev.table(5) == list(table)
    assert dp.maglev.size(5) == size
    assert not dp.maglev.set_table(5, table)  # unchanged: not written again
    hits: collections.Counter[str] = collections.Counter()
    for sport in range(46000, 46200):
        slot = maglev_slot(POD_A.ip, VIP, sport, 80, 6, size=size)
        want = f"10.1.1.{table[slot] - 100 + 1}"
        out = dp.test_run("from_container", P.build(POD_A.ip, VIP, sport=sport, dport=80))
        assert out.retval == L.TC_ACT_OK  # the backends are not local pods
        pkt = P.parse(out.data)
        assert pkt.dst == want, f"sport {sport} slot {slot}"
        assert pkt.l4_csum_ok
        hits[pkt.dst] += 1
    assert len(hits) == 4
    # Same connection, same backend, even after the table changes.
    new_table = tuple(101 for _ in range(size))
    dp.upsert_service(svc(backends, maglev=True, maglev_table=new_table))
    out = dp.test_run("from_container", P.build(POD_A.ip, VIP, sport=46000, dport=80))
    first = f"10.1.1.{table[maglev_slot(POD_A.ip, VIP, 46000, 80, 6, size=size)] - 100 + 1}"
    assert P.parse(out.data).dst == first
    out = dp.test_run("from_container", P.build(POD_A.ip, VIP, sport=46500, dport=80))
    assert P.parse(out.data).dst == "10.1.1.2"


def test_client_ip_affinity(dp: Datapath) -> None:
    ready(dp, POD_A, POD_C)
    backends = tuple(Backend(200 + i, f"10.1.2.{i + 1}", 8080) for i in range(3))
    # Without affinity, random selection spreads new connections.
    dp.upsert_service(svc(backends))
    spread = {
        P.parse(dp.test_run("from_container", P.build(POD_C.ip, VIP, sport=s, dport=80)).data).dst
        for s in range(47000, 47040)
    }
    assert len(spread) > 1

    dp.upsert_service(svc(backends, affinity_timeout=60))
    chosen = {
        P.parse(dp.test_run("from_container", P.build(POD_A.ip, VIP, sport=s, dport=80)).data).dst
        for s in range(47100, 47140)
    }
    assert len(chosen) == 1
    got = dp.affinity.lookup(POD_A.ip, 5)
    assert got is not None
    assert f"10.1.2.{got[0] - 200 + 1}" == chosen.pop()

    # An expired affinity entry no longer binds the client.
    k = L.AffinityKey(service_id=5)
    L.set_addr(k.client, POD_A.ip)
    old = dp.affinity.get(k)
    assert old is not None
    old.last_used -= 61 * 10**9
    dp.affinity.update(k, old)
    later = {
        P.parse(dp.test_run("from_container", P.build(POD_A.ip, VIP, sport=s, dport=80)).data).dst
        for s in range(47200, 47201)
    }
    assert len(later) == 1
    refreshed = dp.affinity.lookup(POD_A.ip, 5)
    assert refreshed is not None
    assert refreshed[1] > old.last_used


def test_source_range_drop(dp: Datapath) -> None:
    outsider = Pod(14, "10.1.0.9", 4000, "0a:00:00:00:04:01", "0a:00:00:00:04:fe")
    ready(dp, POD_A, outsider)
    dp.upsert_service(svc((Backend(7, POD_B.ip, 8080),), source_ranges=("10.1.0.0/30",)))
    assert dp.srcrange.ranges(5) == ["10.1.0.0/30"]
    ok = dp.test_run("from_container", P.build(POD_A.ip, VIP, dport=80))
    assert ok.retval == L.TC_ACT_OK
    assert P.parse(ok.data).dst == POD_B.ip
    denied = dp.test_run("from_container", P.build(outsider.ip, VIP, dport=80))
    assert denied.retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.SOURCE_RANGE, EGRESS) == 1
    # Ranges removed: everyone may connect.
    dp.upsert_service(svc((Backend(7, POD_B.ip, 8080),)))
    assert dp.srcrange.ranges(5) == []
    again = dp.test_run("from_container", P.build(outsider.ip, VIP, sport=1234, dport=80))
    assert again.retval == L.TC_ACT_OK


def test_nodeport_frontend_and_egress_policy_on_the_backend(dp: Datapath) -> None:
    POD_A.add(dp)
    dp.policy.apply(
        POD_A.endpoint_id, [PolicyEntry(POD_B.identity, EGRESS, protocol=6, port=8080)], 1
    )
    ready(dp, POD_B)
    node_ip = "192.168.50.1"
    service = Service(
        service_id=6,
        frontends=(
            Frontend(VIP, 80, 6, rev_nat_id=frontend_rev_nat_id(6, 0)),
            Frontend(node_ip, 30080, 6, rev_nat_id=frontend_rev_nat_id(6, 1), nodeport=True),
        ),
        backends=(Backend(7, POD_B.ip, 8080),),
    )
    dp.upsert_service(service)
    fe = dp.services.frontend(node_ip, 30080, 6)
    assert fe is not None
    assert fe.flags & L.SVC_F_NODEPORT
    out = dp.test_run("from_container", P.build(POD_A.ip, node_ip, sport=48000, dport=30080))
    assert out.retval == L.TC_ACT_REDIRECT
    assert (P.parse(out.data).dst, P.parse(out.data).dport) == (POD_B.ip, 8080)
    # The reply is translated back to the frontend the client used.
    reply = P.build(POD_B.ip, POD_A.ip, sport=8080, dport=48000, flags=P.TCP_ACK)
    pkt = P.parse(dp.test_run("to_container", reply).data)
    assert (pkt.src, pkt.sport) == (node_ip, 30080)

    # Frontends dropped from the service are removed from the map.
    dp.upsert_service(Service(6, service.frontends[:1], service.backends))
    assert dp.services.frontend(node_ip, 30080, 6) is None
    assert dp.services.frontends_of(6) == [(VIP, 80, 6)]


def test_affinity_sticks_until_timeout_but_not_to_a_terminating_backend(dp: Datapath) -> None:
    ready(dp, POD_A, POD_B, POD_C)
    backends = (Backend(7, POD_A.ip, 8080), Backend(8, POD_B.ip, 8080), Backend(9, POD_C.ip, 8080))
    dp.upsert_service(svc(backends, affinity_timeout=60))

    def backend(sport: int, flags: int = P.TCP_SYN) -> str:
        out = dp.test_run("from_container", P.build(POD_A.ip, VIP, sport=sport, flags=flags))
        assert out.retval == L.TC_ACT_REDIRECT
        return P.parse(out.data).dst

    def age(seconds: float) -> None:
        k = L.AffinityKey(service_id=5)
        L.set_addr(k.client, POD_A.ip)
        v = dp.affinity.get(k)
        assert v is not None
        v.last_used -= int(seconds * 10**9)
        dp.affinity.update(k, v)

    first = backend(48100)
    for sport in range(48101, 48121):
        assert backend(sport) == first
    for sport in (48121, 48122):  # just inside the timeout, refreshed by each use
        age(59)
        assert backend(sport) == first
    chosen = set()
    for sport in range(48130, 48150):  # past it: chosen again each time
        age(61)
        chosen.add(backend(sport))
    assert len(chosen) > 1

    current = backend(48200)
    dp.upsert_service(
        svc(
            tuple(Backend(b.id, b.address, 8080, state=2 if b.address == current else 1)
                  for b in backends),
            affinity_timeout=60,
        )
    )  # fmt: skip
    assert backend(48200, P.TCP_ACK) == current  # established: stays
    moved = backend(48201)  # new: the affinity entry points at a terminating backend
    assert moved != current
    assert {backend(s) for s in range(48202, 48220)} == {moved}
    got = dp.affinity.lookup(POD_A.ip, 5)
    assert got is not None
    assert got[0] == next(b.id for b in backends if b.address == moved)


def test_maglev_tables_of_hundreds_of_services(dp: Datapath) -> None:
    """200 services at M = 16381 (the old flat map held 64): each service
    has its own table, selection follows each one, and a table's memory
    goes with its service."""
    ready(dp, POD_A)
    size = 16381
    n = 200
    backends = tuple(Backend(300 + i, f"10.1.3.{i + 1}", 8080) for i in range(5))
    for i in range(n):
        # Each service's table differs (rotated), so a wrong table shows.
        table = tuple(300 + (j + i) % 5 for j in range(size))
        dp.upsert_service(
            Service(
                service_id=1000 + i,
                frontends=(Frontend(f"10.97.{i // 200}.{i % 200 + 1}", 80, 6, 1000 + i),),
                backends=backends,
                maglev=True,
                maglev_table=table,
            )
        )
    assert dp.maglev.count() == n
    status = {s.name: s for s in dp.map_status()}["maglev"]
    assert (status.type, status.entries) == ("hash_of_maps", n)
    for i in range(0, n, 7):
        vip = f"10.97.{i // 200}.{i % 200 + 1}"
        slot = maglev_slot(POD_A.ip, vip, 40000 + i, 80, 6, size=size)
        out = dp.test_run("from_container", P.build(POD_A.ip, vip, sport=40000 + i, dport=80))
        assert out.retval == L.TC_ACT_OK
        assert P.parse(out.data).dst == f"10.1.3.{(slot + i) % 5 + 1}", f"service {i}"
    rows = {k["service_id"]: v for k, v in dp.dump("maglev")}
    assert len(rows) == n
    assert rows["1000"]["size"] == str(size)
    assert rows["1000"]["slots"] == "300:3277,301:3276,302:3276,303:3276,304:3276"
    # Deleting services frees their tables.
    for i in range(n):
        dp.delete_service(1000 + i)
    assert dp.maglev.count() == 0


def test_frontends_of_a_service_survive_a_reopen_and_a_move(
    dp: Datapath, bpf_programs: Programs
) -> None:
    """The datapath finds a service's frontends through an index kept
    beside the map: a new process on the same pins rebuilds it from the map,
    and a frontend taken over by another service leaves the first one's."""
    ready(dp, POD_B)
    fe = [
        Frontend(f"10.96.5.{i}", 80, 6, rev_nat_id=frontend_rev_nat_id(40 + i, 0)) for i in range(3)
    ]
    be = (Backend(70, POD_B.ip, 8080),)
    dp.upsert_service(Service(40, tuple(fe[:2]), be))
    dp.upsert_service(Service(41, (fe[2],), be))
    assert dp.services.frontends_of(40) == [(fe[0].address, 80, 6), (fe[1].address, 80, 6)]

    again = Datapath.load(dp.folder.parent, programs=bpf_programs, sizes=dp.sizes)
    try:
        assert again.services.frontends_of(40) == [(fe[0].address, 80, 6), (fe[1].address, 80, 6)]
        assert again.services.service_ids() == {40, 41}
        # Service 41 takes over 10.96.5.1 from 40; 40 keeps only 10.96.5.0.
        again.upsert_service(Service(41, (fe[2], fe[1]), be))
        assert again.services.frontends_of(40) == [(fe[0].address, 80, 6)]
        assert again.services.frontends_of(41) == [(fe[1].address, 80, 6), (fe[2].address, 80, 6)]
        # Deleting 40 removes only what it still has.
        assert again.delete_service(40)
        assert again.services.frontend(fe[0].address, 80, 6) is None
        assert again.services.frontend(fe[1].address, 80, 6) is not None
        assert again.services.service_ids() == {41}
    finally:
        again.close()
