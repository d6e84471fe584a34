"""Masquerade on the uplink (to_netdev) and its reverse (from_netdev) with
BPF_PROG_TEST_RUN."""

from __future__ import annotations

import pytest
from harness.bpf import POD_A, POD_A6, POD_B, WORLD_IP

from flagella.datapath.bpf import Datapath, DropReason, NodeConfig
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P

pytestmark = pytest.mark.privileged

NODE_IP = "192.168.50.1"
NODE_IP6 = "fd00:50::1"
WORLD_IP6 = "2001:db8::10"


def setup(dp: Datapath, **kw: object) -> None:
    cfg = NodeConfig(node_ip4=NODE_IP, node_ip6=NODE_IP6, masquerade4=True, masquerade6=True)
    dp.config.write(NodeConfig(**{**cfg.__dict__, **kw}))  # type: ignore[arg-type]
    for pod in (POD_A, POD_B, POD_A6):
        pod.add(dp)
        dp.policy.apply(pod.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)


def test_masquerade_and_reverse_tcp(dp: Datapath) -> None:
    setup(dp)
    frame = P.build(POD_A.ip, WORLD_IP, sport=40000, dport=443, payload=b"hello")
    out = dp.test_run("to_netdev", frame)
    assert out.retval == L.TC_ACT_OK
    snat = P.parse(out.data)
    assert (snat.src, snat.dst, snat.dport) == (NODE_IP, WORLD_IP, 443)
    assert 61000 <= snat.sport <= 65535
    assert snat.l3_csum_ok
    assert snat.l4_csum_ok
    # The next packet of the flow keeps its port.
    again = P.parse(dp.test_run("to_netdev", P.build(POD_A.ip, WORLD_IP, sport=40000, dport=443,
                                                     flags=P.TCP_ACK)).data)  # fmt: skip
    assert again.sport == snat.sport

    reply = P.build(WORLD_IP, NODE_IP, sport=443, dport=snat.sport, flags=P.TCP_SYN | P.TCP_ACK)
    back = dp.test_run("from_netdev", reply)
    assert back.retval == L.TC_ACT_REDIRECT  # straight to A's veth
    pkt = P.parse(back.data)
    assert (pkt.src, pkt.sport, pkt.dst, pkt.dport) == (WORLD_IP, 443, POD_A.ip, 40000)
    assert pkt.l3_csum_ok
    assert pkt.l4_csum_ok
    assert pkt.dst_mac == POD_A.mac_bytes

    entries = {(t.src, t.dst, t.sport, t.dport, d, ip, port) for t, d, ip, port in dp.nat.entries()}
    assert (POD_A.ip, WORLD_IP, 40000, 443, L.NAT_OUT, NODE_IP, snat.sport) in entries
    assert (WORLD_IP, NODE_IP, 443, snat.sport, L.NAT_IN, POD_A.ip, 40000) in entries


def test_masquerade_udp_icmp_and_ipv6(dp: Datapath) -> None:
    setup(dp)
    udp = P.parse(dp.test_run("to_netdev", P.build(POD_A.ip, WORLD_IP, proto=17, sport=5353,
                                                   dport=53)).data)  # fmt: skip
    assert (udp.src, udp.l3_csum_ok, udp.l4_csum_ok) == (NODE_IP, True, True)

    echo = dp.test_run("to_netdev", P.build(POD_A.ip, WORLD_IP, proto=1, icmp_id=0x4242))
    e = P.parse(echo.data)
    assert e.src == NODE_IP
    assert e.l4_csum_ok
    nat_id = e.sport
    assert 61000 <= nat_id <= 65535
    reply = P.build(WORLD_IP, NODE_IP, proto=1, icmp_type=0, icmp_id=nat_id)
    r = P.parse(dp.test_run("from_netdev", reply).data)
    assert (r.dst, r.sport, r.l3_csum_ok, r.l4_csum_ok) == (POD_A.ip, 0x4242, True, True)

    v6 = P.parse(dp.test_run("to_netdev", P.build(POD_A6.ip, WORLD_IP6, sport=40001,
                                                  dport=443)).data)  # fmt: skip
    assert (v6.src, v6.l4_csum_ok) == (NODE_IP6, True)
    back6 = P.build(WORLD_IP6, NODE_IP6, sport=443, dport=v6.sport, flags=P.TCP_ACK)
    b6 = P.parse(dp.test_run("from_netdev", back6).data)
    assert (b6.dst, b6.dport, b6.l4_csum_ok) == (POD_A6.ip, 40001, True)


def test_no_masquerade_inside_the_cluster_or_when_off(dp: Datapath) -> None:
    setup(dp)
    dp.ipcache.upsert("10.2.0.0/16", int(L.Identity.REMOTE_NODE))
    dp.ipcache.upsert("10.3.0.5/32", 5000)  # a pod on another node
    for dst in ("10.2.0.7", "10.3.0.5"):
        frame = P.build(POD_A.ip, dst)
        out = dp.test_run("to_netdev", frame)
        assert (out.retval, out.data) == (L.TC_ACT_OK, frame)
    # The node's own traffic is not touched either way.
    own = P.build(NODE_IP, WORLD_IP, sport=33000)
    assert dp.test_run("to_netdev", own).data == own
    unrelated = P.build(WORLD_IP, NODE_IP, sport=443, dport=33000)
    assert dp.test_run("from_netdev", unrelated).data == unrelated

    setup(dp, masquerade4=False)
    frame = P.build(POD_A.ip, WORLD_IP, sport=40002)
    assert dp.test_run("to_netdev", frame).data == frame


def test_nat_port_exhaustion_drops(dp: Datapath) -> None:
    setup(dp, nat_port_min=62000, nat_port_max=62000)
    first = P.parse(dp.test_run("to_netdev", P.build(POD_A.ip, WORLD_IP, sport=1)).data)
    assert first.sport == 62000
    out = dp.test_run("to_netdev", P.build(POD_B.ip, WORLD_IP, sport=1))
    assert out.retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.NAT_FAILED) == 1
    # GC of expired entries frees the port.
    assert dp.gc(now_ns=2**63).nat == 2
    again = P.parse(dp.test_run("to_netdev", P.build(POD_B.ip, WORLD_IP, sport=1)).data)
    assert again.sport == 62000
