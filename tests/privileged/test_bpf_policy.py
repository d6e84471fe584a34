"""Policy enforcement of from_container / to_container with
BPF_PROG_TEST_RUN on synthetic packets."""

from __future__ import annotations

import pytest
from harness.bpf import POD_A, POD_A6, POD_B, POD_B6, WORLD_IP

from flagella.datapath.bpf import Datapath, Direction, DropReason, Identity, NodeConfig, PolicyEntry
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P

pytestmark = pytest.mark.privileged

EGRESS, INGRESS = Direction.EGRESS, Direction.INGRESS
ALLOW, DENY = L.Verdict.ALLOW, L.Verdict.DENY


def open_all(dp: Datapath, *pods: object) -> None:
    """Pods with policy applied and nothing enforced."""
    for pod in pods:
        pod.add(dp)  # type: ignore[attr-defined]
        dp.policy.apply(pod.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)  # type: ignore[attr-defined]


def ingress(dp: Datapath, frame: bytes) -> int:
    return dp.test_run("to_container", frame).retval


def egress(dp: Datapath, frame: bytes) -> int:
    return dp.test_run("from_container", frame).retval


def test_allowed_both_ways_redirects_to_local_pod(dp: Datapath) -> None:
    POD_A.add(dp)
    POD_B.add(dp)
    dp.policy.apply(
        POD_A.endpoint_id, [PolicyEntry(POD_B.identity, EGRESS, protocol=6, port=80)], 7
    )
    dp.policy.apply(
        POD_B.endpoint_id, [PolicyEntry(POD_A.identity, INGRESS, protocol=6, port=80)], 7
    )

    out = dp.test_run("from_container", P.build(POD_A.ip, POD_B.ip, dport=80))
    assert out.retval == L.TC_ACT_REDIRECT
    pkt = P.parse(out.data)
    # Ethernet addresses of the destination pod, from its host-side veth.
    assert pkt.dst_mac == POD_B.mac_bytes
    assert pkt.src_mac == POD_B.node_mac_bytes
    assert (pkt.src, pkt.dst, pkt.dport) == (POD_A.ip, POD_B.ip, 80)
    assert ingress(dp, out.data) == L.TC_ACT_OK

    assert dp.metrics.forwarded(EGRESS) == 1
    assert dp.metrics.forwarded(INGRESS) == 1
    assert dp.endpoints.realized_revision(POD_A.endpoint_id) == 7
    with dp.events() as ev:
        flows = ev.read()
    verdicts = [f for f in flows if f.type == L.FlowType.POLICY_VERDICT]
    assert {(f.direction, f.src_identity, f.dst_identity) for f in verdicts} == {
        (EGRESS, POD_A.identity, POD_B.identity),
        (INGRESS, POD_A.identity, POD_B.identity),
    }


def test_verdict_event_levels(dp: Datapath) -> None:
    """--verdict-events: all reports an allowed new connection at both
    ends; enforced only where the endpoint's policy is enforced in that
    direction (A's egress here, not B's ingress); none not at all. Drops
    are reported at every level."""
    POD_A.add(dp)
    POD_B.add(dp)
    dp.policy.apply(
        POD_A.endpoint_id, [PolicyEntry(POD_B.identity, EGRESS, protocol=6, port=80)], 1
    )
    dp.policy.apply(POD_B.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)
    levels = {
        "all": NodeConfig(),
        "enforced": NodeConfig(verdict_enforced_only=True),
        "none": NodeConfig(verdict_events=False, verdict_enforced_only=True),
    }
    seen = {}
    with dp.events() as ev:
        ev.read()
        for sport, (level, cfg) in enumerate(levels.items(), start=41000):
            dp.config.write(cfg)
            out = dp.test_run("from_container", P.build(POD_A.ip, POD_B.ip, sport=sport, dport=80))
            assert out.retval == L.TC_ACT_REDIRECT
            assert ingress(dp, out.data) == L.TC_ACT_OK
            # A drop: A's egress to a port its policy does not allow.
            assert egress(dp, P.build(POD_A.ip, POD_B.ip, sport=sport, dport=81)) == L.TC_ACT_SHOT
            flows = ev.read()
            seen[level] = (
                {f.direction for f in flows if f.type == L.FlowType.POLICY_VERDICT},
                [f.drop_reason for f in flows if f.type == L.FlowType.DROP],
            )
    drop = [DropReason.POLICY_L4]
    assert seen == {
        "all": ({EGRESS, INGRESS}, drop),
        "enforced": ({EGRESS}, drop),
        "none": (set(), drop),
    }
    # none: the enforced bit means nothing without verdict events.
    assert not dp.config.read().verdict_enforced_only


def test_deny_l3_no_entry_for_the_peer(dp: Datapath) -> None:
    open_all(dp, POD_A)
    POD_B.add(dp)
    dp.policy.apply(POD_B.endpoint_id, [PolicyEntry(3000, INGRESS, protocol=6, port=80)], 1)

    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, dport=80)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_L3, INGRESS) == 1
    with dp.events() as ev:
        drops = [f for f in ev.read() if f.type == L.FlowType.DROP]
    assert len(drops) == 1
    d = drops[0]
    assert d.drop_reason == DropReason.POLICY_L3
    assert d.verdict == L.FlowVerdict.DROPPED
    assert (d.src_identity, d.dst_identity) == (POD_A.identity, POD_B.identity)
    assert (d.src_ip, d.dst_ip, d.dst_port, d.protocol) == (POD_A.ip, POD_B.ip, 80, 6)
    assert d.endpoint_id == POD_B.endpoint_id
    assert d.direction == INGRESS
    assert (d.tcp_flags, d.icmp_type) == (P.TCP_SYN, 0)  # Hubble's l4 flags


def test_deny_l4_peer_allowed_on_other_ports_only(dp: Datapath) -> None:
    POD_A.add(dp)
    dp.policy.apply(
        POD_A.endpoint_id, [PolicyEntry(POD_B.identity, EGRESS, protocol=6, port=80)], 1
    )
    POD_B.add(dp)
    dp.policy.apply(POD_B.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)

    assert egress(dp, P.build(POD_A.ip, POD_B.ip, dport=80)) == L.TC_ACT_REDIRECT
    assert egress(dp, P.build(POD_A.ip, POD_B.ip, sport=40001, dport=81)) == L.TC_ACT_SHOT
    assert egress(dp, P.build(POD_A.ip, POD_B.ip, proto=17, dport=80)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_L4, EGRESS) == 2
    # Another peer has no entry at all: L3.
    dp.ipcache.upsert("10.9.0.0/16", 4242)
    assert egress(dp, P.build(POD_A.ip, "10.9.0.1", dport=80)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_L3, EGRESS) == 1


def test_port_range(dp: Datapath) -> None:
    open_all(dp, POD_A)
    POD_B.add(dp)
    dp.policy.apply(
        POD_B.endpoint_id,
        [PolicyEntry(POD_A.identity, INGRESS, protocol=6, port=8000, end_port=8099)],
        1,
    )
    for sport, dport, want in [
        (50000, 8000, L.TC_ACT_OK),
        (50001, 8050, L.TC_ACT_OK),
        (50002, 8099, L.TC_ACT_OK),
        (50003, 7999, L.TC_ACT_SHOT),
        (50004, 8100, L.TC_ACT_SHOT),
        (50005, 80, L.TC_ACT_SHOT),
    ]:
        got = ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=sport, dport=dport))
        assert got == want, f"port {dport}"
    assert dp.metrics.drops(DropReason.POLICY_L4, INGRESS) == 3
    # 8000-8099 is 8000/10 (8000-8063), 8064/11 (-8095), 8096/14 (-8099):
    # three keys, plus the L4 marker of the peer.
    assert dp.policy.entry_count(POD_B.endpoint_id) == 4


def test_deny_over_allow(dp: Datapath) -> None:
    open_all(dp, POD_A)
    POD_B.add(dp)
    dp.policy.apply(
        POD_B.endpoint_id,
        [
            PolicyEntry(POD_A.identity, INGRESS),  # every port
            PolicyEntry(POD_A.identity, INGRESS, DENY, protocol=6, port=22),
            PolicyEntry(0, INGRESS, DENY, protocol=6, port=6000, end_port=6010),  # any peer
            PolicyEntry(POD_A.identity, INGRESS, protocol=6, port=6005),  # shadowed
        ],
        1,
    )
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=41000, dport=80)) == L.TC_ACT_OK
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=41001, dport=22)) == L.TC_ACT_SHOT
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=41002, dport=6005)) == L.TC_ACT_SHOT
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=41003, dport=6011)) == L.TC_ACT_OK
    assert dp.metrics.drops(DropReason.POLICY_DENY, INGRESS) == 2

    # A deny of every port of a peer wins over its more specific allow.
    dp.policy.apply(
        POD_B.endpoint_id,
        [
            PolicyEntry(POD_A.identity, INGRESS, DENY),
            PolicyEntry(POD_A.identity, INGRESS, protocol=6, port=80),
        ],
        2,
    )
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=41004, dport=80)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_DENY, INGRESS) == 3


def test_policy_not_ready_drops_until_applied(dp: Datapath) -> None:
    POD_A.add(dp)
    POD_B.add(dp)
    frame = P.build(POD_A.ip, POD_B.ip)
    assert egress(dp, frame) == L.TC_ACT_SHOT
    assert ingress(dp, frame) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_NOT_READY, EGRESS) == 1
    assert dp.metrics.drops(DropReason.POLICY_NOT_READY, INGRESS) == 1
    assert dp.endpoints.realized_revision(POD_A.endpoint_id) is None

    # Even "nothing enforced" must be applied explicitly before traffic flows.
    dp.policy.apply(POD_A.endpoint_id, [], 3, ingress_enforced=False, egress_enforced=False)
    dp.policy.apply(POD_B.endpoint_id, [], 3, ingress_enforced=False, egress_enforced=False)
    assert egress(dp, frame) == L.TC_ACT_REDIRECT
    assert ingress(dp, frame) == L.TC_ACT_OK

    dp.endpoints.set_not_ready(POD_B.endpoint_id)
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=40100)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_NOT_READY, INGRESS) == 2


def test_conntrack_reply_allowed_after_egress_only_allow(dp: Datapath) -> None:
    # A may open connections to B, and accepts nothing (ingress enforced,
    # no entries); B accepts from A.
    POD_A.add(dp)
    dp.policy.apply(
        POD_A.endpoint_id, [PolicyEntry(POD_B.identity, EGRESS, protocol=6, port=80)], 1
    )
    POD_B.add(dp)
    dp.policy.apply(
        POD_B.endpoint_id, [PolicyEntry(POD_A.identity, INGRESS, protocol=6, port=80)], 1
    )

    syn = P.build(POD_A.ip, POD_B.ip, sport=43000, dport=80, flags=P.TCP_SYN)
    assert egress(dp, syn) == L.TC_ACT_REDIRECT
    assert ingress(dp, syn) == L.TC_ACT_OK
    synack = P.build(POD_B.ip, POD_A.ip, sport=80, dport=43000, flags=P.TCP_SYN | P.TCP_ACK)
    assert egress(dp, synack) == L.TC_ACT_REDIRECT  # B's side: reply of ingress entry
    assert ingress(dp, synack) == L.TC_ACT_OK  # A's side: reply of A's egress entry

    # The same peer opening a connection to A is not a reply: dropped.
    new = P.build(POD_B.ip, POD_A.ip, sport=80, dport=43001)
    assert ingress(dp, new) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_L3, INGRESS) == 1

    entries = dp.conntrack.entries(L.CT_SCOPE_EGRESS)
    assert len(entries) == 1
    t, _, e = entries[0]
    assert (t.src, t.dst, t.sport, t.dport, t.proto) == (POD_A.ip, POD_B.ip, 43000, 80, 6)
    assert e.flags & L.CT_F_REPLY_SEEN
    assert e.identity == POD_B.identity


def test_policy_change_applies_to_established_connections(dp: Datapath) -> None:
    open_all(dp, POD_A)
    POD_B.add(dp)
    dp.policy.apply(POD_B.endpoint_id, [PolicyEntry(POD_A.identity, INGRESS)], 1)
    first = P.build(POD_A.ip, POD_B.ip, sport=44000, dport=80, flags=P.TCP_SYN)
    later = P.build(POD_A.ip, POD_B.ip, sport=44000, dport=80, flags=P.TCP_ACK)
    assert ingress(dp, first) == L.TC_ACT_OK
    assert ingress(dp, later) == L.TC_ACT_OK

    dp.policy.apply(POD_B.endpoint_id, [PolicyEntry(POD_A.identity, INGRESS, DENY)], 2)
    assert ingress(dp, later) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_DENY, INGRESS) == 1

    dp.policy.apply(POD_B.endpoint_id, [PolicyEntry(POD_A.identity, INGRESS)], 3)
    assert ingress(dp, later) == L.TC_ACT_OK


def test_host_always_reaches_local_pods_and_world_is_identity_2(dp: Datapath) -> None:
    dp.config.write(NodeConfig(node_ip4="192.168.50.1"))
    POD_B.add(dp)
    dp.policy.apply(
        POD_B.endpoint_id, [PolicyEntry(int(Identity.WORLD), INGRESS, protocol=6, port=80)], 1
    )
    # The node itself (allow-host, as Cilium's allow-localhost).
    assert ingress(dp, P.build("192.168.50.1", POD_B.ip, dport=9090)) == L.TC_ACT_OK
    # An address the ipcache does not know is world.
    assert ingress(dp, P.build(WORLD_IP, POD_B.ip, sport=1000, dport=80)) == L.TC_ACT_OK
    # Once a CIDR identity covers it, world's entry no longer applies.
    dp.ipcache.upsert("203.0.113.0/24", L.LOCAL_IDENTITY_SCOPE + 1)
    assert dp.ipcache.lookup(WORLD_IP) == L.LOCAL_IDENTITY_SCOPE + 1
    assert ingress(dp, P.build(WORLD_IP, POD_B.ip, sport=1001, dport=80)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_L3, INGRESS) == 1
    # With allow-host off, the host is judged like any peer.
    dp.config.write(NodeConfig(node_ip4="192.168.50.1", allow_host=False))
    assert ingress(dp, P.build("192.168.50.1", POD_B.ip, sport=1002, dport=9090)) == L.TC_ACT_SHOT


def test_icmp_policy_matches_the_type(dp: Datapath) -> None:
    open_all(dp, POD_A)
    POD_B.add(dp)
    dp.policy.apply(
        POD_B.endpoint_id,
        [PolicyEntry(POD_A.identity, INGRESS, protocol=1, port=L.ICMP_TYPE_PORT | 8)],
        1,
    )
    echo = P.build(POD_A.ip, POD_B.ip, proto=1, icmp_type=8, icmp_id=7)
    assert ingress(dp, echo) == L.TC_ACT_OK
    reply = P.build(POD_B.ip, POD_A.ip, proto=1, icmp_type=0, icmp_id=7)
    assert egress(dp, reply) == L.TC_ACT_REDIRECT  # reply of the ingress entry, to A
    # Timestamp request (type 13) is not allowed.
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, proto=1, icmp_type=13, icmp_id=8)) == (
        L.TC_ACT_SHOT
    )
    assert dp.metrics.drops(DropReason.POLICY_L4, INGRESS) == 1


def test_icmp_type_zero_is_its_own_key_and_icmpv6_types_match(dp: Datapath) -> None:
    """Type 0 (echo reply) allowed alone is not "every type"; ICMPv6 types
    are keyed under their own protocol."""
    open_all(dp, POD_A, POD_A6)
    POD_B.add(dp)
    POD_B6.add(dp)
    dp.policy.apply(
        POD_B.endpoint_id,
        [PolicyEntry(POD_A.identity, INGRESS, protocol=1, port=L.ICMP_TYPE_PORT | 0)],
        1,
    )
    dp.policy.apply(
        POD_B6.endpoint_id,
        [PolicyEntry(POD_A6.identity, INGRESS, protocol=58, port=L.ICMP_TYPE_PORT | 128)],
        1,
    )
    unsolicited_reply = P.build(POD_A.ip, POD_B.ip, proto=1, icmp_type=0, icmp_id=9)
    assert ingress(dp, unsolicited_reply) == L.TC_ACT_OK
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, proto=1, icmp_type=8, icmp_id=10)) == (
        L.TC_ACT_SHOT
    )
    echo6 = P.build(POD_A6.ip, POD_B6.ip, proto=58, icmp_type=128, icmp_id=11)
    assert ingress(dp, echo6) == L.TC_ACT_OK
    # ICMPv6 type 8 is not ICMPv4's echo request, and 129 was not allowed.
    assert ingress(dp, P.build(POD_A6.ip, POD_B6.ip, proto=58, icmp_type=8, icmp_id=12)) == (
        L.TC_ACT_SHOT
    )
    assert ingress(dp, P.build(POD_A6.ip, POD_B6.ip, proto=58, icmp_type=129, icmp_id=13)) == (
        L.TC_ACT_SHOT
    )
    assert dp.metrics.drops(DropReason.POLICY_L4, INGRESS) == 3
    with dp.events() as ev:
        drops = [f for f in ev.read() if f.type == L.FlowType.DROP]
    assert [(f.protocol, f.icmp_type, f.tcp_flags) for f in drops] == [
        (1, 8, 0), (58, 8, 0), (58, 129, 0)
    ]  # fmt: skip


def test_ipv6_policy(dp: Datapath) -> None:
    open_all(dp, POD_A6)
    POD_B6.add(dp)
    dp.policy.apply(
        POD_B6.endpoint_id, [PolicyEntry(POD_A6.identity, INGRESS, protocol=17, port=53)], 1
    )
    out = dp.test_run("from_container", P.build(POD_A6.ip, POD_B6.ip, proto=17, dport=53))
    assert out.retval == L.TC_ACT_REDIRECT
    assert P.parse(out.data).dst_mac == POD_B6.mac_bytes
    assert ingress(dp, out.data) == L.TC_ACT_OK
    assert ingress(dp, P.build(POD_A6.ip, POD_B6.ip, proto=17, dport=54)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_L4, INGRESS) == 1
    # Neighbour discovery passes untouched.
    ns = P.build(POD_A6.ip, POD_B6.ip, proto=58, icmp_type=135)
    assert ingress(dp, ns) == L.TC_ACT_OK


def test_spoofed_source_and_fragments_are_dropped(dp: Datapath) -> None:
    open_all(dp, POD_A, POD_B)
    assert egress(dp, P.build("10.1.0.99", POD_B.ip)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.INVALID_SOURCE_IP, EGRESS) == 1
    # A's address on another interface than its own veth.
    dp.endpoints.upsert(
        POD_A.endpoint_id, [POD_A.ip], ifindex=4242, identity=POD_A.identity,
        mac=POD_A.mac, node_mac=POD_A.node_mac,
    )  # fmt: skip
    assert egress(dp, P.build(POD_A.ip, POD_B.ip)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.INVALID_SOURCE_IP, EGRESS) == 2
    frag = P.build(POD_B.ip, POD_A.ip, frag_off=100)
    assert egress(dp, frag) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.FRAG_NOT_SUPPORTED, EGRESS) == 1
    arp = bytes(6) + bytes(6) + b"\x08\x06" + bytes(28)
    assert egress(dp, arp) == L.TC_ACT_OK
    other = bytes(12) + b"\x88\xcc" + bytes(40)  # LLDP
    assert egress(dp, other) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.UNSUPPORTED_L3, EGRESS) == 1


def test_icmp_errors_of_tracked_connections_pass(dp: Datapath) -> None:
    # A may only talk to the world on UDP 53 and accepts nothing.
    POD_A.add(dp)
    dp.policy.apply(
        POD_A.endpoint_id, [PolicyEntry(int(Identity.WORLD), EGRESS, protocol=17, port=53)], 1
    )
    query = P.build(POD_A.ip, WORLD_IP, proto=17, sport=5300, dport=53)
    assert egress(dp, query) == L.TC_ACT_OK

    def unreachable(sport: int) -> bytes:
        quoted = P.build(POD_A.ip, WORLD_IP, proto=17, sport=sport, dport=53)[14 : 14 + 28]
        return P.build(WORLD_IP, POD_A.ip, proto=1, icmp_type=3, icmp_id=0, payload=quoted)

    assert ingress(dp, unreachable(5300)) == L.TC_ACT_OK  # related to A's query
    assert ingress(dp, unreachable(5301)) == L.TC_ACT_SHOT  # about nothing A sent
    assert dp.metrics.drops(DropReason.POLICY_L3, INGRESS) == 1
