"""Kubernetes ipBlocks over peer addresses (the prefix_policy map) in
from_container / to_container, with BPF_PROG_TEST_RUN on synthetic
packets: per address (two pods of one identity treated differently),
excepts, ports, IPv6, deny entries still winning, revalidation of
established connections, the endpoint flag, the limits."""

from __future__ import annotations

import pytest
from harness.bpf import POD_A, POD_A6, POD_B, POD_B6, WORLD_IP, Pod

from flagella.datapath.bpf import Datapath, Direction, DropReason, PolicyBudgetExceeded, PolicyEntry
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.bpf.prefixpolicy import PrefixRule

pytestmark = pytest.mark.privileged

EGRESS, INGRESS = Direction.EGRESS, Direction.INGRESS
TCP, UDP = 6, 17
# Same identity as POD_A, another address.
POD_A2 = Pod(14, "10.1.0.4", POD_A.identity, "0a:00:00:00:04:01", "0a:00:00:00:04:fe")


def ingress(dp: Datapath, frame: bytes) -> int:
    return dp.test_run("to_container", frame).retval


def egress(dp: Datapath, frame: bytes) -> int:
    return dp.test_run("from_container", frame).retval


def open_all(dp: Datapath, *pods: Pod) -> None:
    for pod in pods:
        pod.add(dp)
        dp.policy.apply(pod.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)


def flags(dp: Datapath, pod: Pod) -> int:
    (state,) = [s for s in dp.endpoints.all() if s.endpoint_id == pod.endpoint_id]
    return state.flags


BLOCK = [
    PrefixRule("10.1.0.0/24", INGRESS, ((TCP, 80, 0),)),
    PrefixRule("10.1.0.4/32", INGRESS, ()),  # the except
]


def test_two_pods_of_one_identity_one_in_the_except(dp: Datapath) -> None:
    open_all(dp, POD_A, POD_A2)
    POD_B.add(dp)
    dp.policy.apply(POD_B.endpoint_id, [], 1, prefixes=BLOCK)

    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, dport=80)) == L.TC_ACT_OK
    assert ingress(dp, P.build(POD_A2.ip, POD_B.ip, dport=80)) == L.TC_ACT_SHOT
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=40001, dport=81)) == L.TC_ACT_SHOT
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, sport=40002, proto=UDP, dport=80)) == (
        L.TC_ACT_SHOT
    )
    # A miss keeps the identity lookups' reason.
    assert dp.metrics.drops(DropReason.POLICY_L3, INGRESS) == 3
    assert dp.prefix_policy.allows(POD_B.endpoint_id, INGRESS, POD_A.ip, TCP, 80)
    assert not dp.prefix_policy.allows(POD_B.endpoint_id, INGRESS, POD_A2.ip, TCP, 80)
    assert dp.prefix_policy.entry_count(POD_B.endpoint_id) == 2


def test_egress_to_the_backend_address_and_outside(dp: Datapath) -> None:
    POD_A.add(dp)
    open_all(dp, POD_B)
    dp.policy.apply(
        POD_A.endpoint_id,
        [],
        1,
        ingress_enforced=False,
        prefixes=[
            PrefixRule("10.1.0.2/32", EGRESS, ((0, 0, 0),)),
            PrefixRule("203.0.113.0/24", EGRESS, ((TCP, 443, 0), (UDP, 53, 0))),
        ],
    )
    assert egress(dp, P.build(POD_A.ip, POD_B.ip, dport=9999)) == L.TC_ACT_REDIRECT
    assert egress(dp, P.build(POD_A.ip, "10.1.0.3", dport=80)) == L.TC_ACT_SHOT
    assert egress(dp, P.build(POD_A.ip, WORLD_IP, dport=443)) == L.TC_ACT_OK
    assert egress(dp, P.build(POD_A.ip, WORLD_IP, sport=40000, proto=UDP, dport=53)) == (
        L.TC_ACT_OK
    )
    assert egress(dp, P.build(POD_A.ip, WORLD_IP, sport=40001, dport=80)) == L.TC_ACT_SHOT
    # Ingress prefixes do not apply to egress.
    assert dp.metrics.drops(DropReason.POLICY_L3, EGRESS) == 2


IPV6_BLOCKS = [
    PrefixRule("fd00:1::/64", INGRESS, ((TCP, 8000, 8099),)),
    PrefixRule("fd00:1::1/128", INGRESS, ((TCP, 22, 0),)),
    PrefixRule("::/0", INGRESS, ((UDP, 0, 0),)),
]


def test_ipv6(dp: Datapath) -> None:
    open_all(dp, POD_A6)
    POD_B6.add(dp)
    dp.policy.apply(POD_B6.endpoint_id, [], 1, prefixes=IPV6_BLOCKS)
    assert ingress(dp, P.build(POD_A6.ip, POD_B6.ip, dport=22)) == L.TC_ACT_OK
    # The longest prefix decides: the /128 allows 22 only.
    assert ingress(dp, P.build(POD_A6.ip, POD_B6.ip, sport=40001, dport=8050)) == L.TC_ACT_SHOT
    assert ingress(dp, P.build("fd00:1::9", POD_B6.ip, sport=40002, dport=8050)) == L.TC_ACT_OK
    assert ingress(dp, P.build("fd00:2::9", POD_B6.ip, sport=40003, dport=8050)) == L.TC_ACT_SHOT
    assert ingress(dp, P.build("fd00:2::9", POD_B6.ip, proto=UDP, dport=53)) == L.TC_ACT_OK
    # An IPv6 /0 never matches an IPv4 (v4-mapped) address: the family is
    # in the key (a lookup in the kernel's map).
    assert dp.prefix_policy.allows(POD_B6.endpoint_id, INGRESS, "::ffff:10.1.0.1", UDP, 53)
    assert not dp.prefix_policy.allows(POD_B6.endpoint_id, INGRESS, "10.1.0.1", UDP, 53)


def test_a_deny_entry_still_wins(dp: Datapath) -> None:
    open_all(dp, POD_A, POD_A2)
    POD_B.add(dp)
    dp.policy.apply(
        POD_B.endpoint_id,
        [PolicyEntry(POD_A.identity, INGRESS, L.Verdict.DENY)],
        1,
        prefixes=[PrefixRule("10.1.0.0/24", INGRESS, ((0, 0, 0),))],
    )
    assert ingress(dp, P.build(POD_A.ip, POD_B.ip, dport=80)) == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_DENY, INGRESS) == 1


def test_established_connections_follow_prefix_changes(dp: Datapath) -> None:
    open_all(dp, POD_A)
    POD_B.add(dp)
    allow = [PrefixRule("10.1.0.0/24", INGRESS, ((TCP, 80, 0),))]
    dp.policy.apply(POD_B.endpoint_id, [], 1, prefixes=allow)
    first = P.build(POD_A.ip, POD_B.ip, sport=44000, dport=80, flags=P.TCP_SYN)
    later = P.build(POD_A.ip, POD_B.ip, sport=44000, dport=80, flags=P.TCP_ACK)
    assert ingress(dp, first) == L.TC_ACT_OK
    assert ingress(dp, later) == L.TC_ACT_OK

    # An except for A's address: the established connection is cut.
    dp.policy.apply(
        POD_B.endpoint_id, [], 2, prefixes=[*allow, PrefixRule("10.1.0.1/32", INGRESS, ())]
    )
    assert ingress(dp, later) == L.TC_ACT_SHOT
    dp.policy.apply(POD_B.endpoint_id, [], 3, prefixes=allow)
    assert ingress(dp, later) == L.TC_ACT_OK
    # No prefixes at all: the map is emptied for the endpoint, the flag off.
    dp.policy.apply(POD_B.endpoint_id, [], 4)
    assert dp.prefix_policy.entry_count(POD_B.endpoint_id) == 0
    assert ingress(dp, later) == L.TC_ACT_SHOT


def test_flag_and_clear(dp: Datapath) -> None:
    POD_B.add(dp)
    dp.policy.apply(POD_B.endpoint_id, [], 1, prefixes=BLOCK)
    assert flags(dp, POD_B) & L.EP_F_PREFIX_POLICY
    assert "prefix-policy" in dp.dump("endpoints")[0][1]["flags"]
    rows = dp.dump("prefix_policy")
    assert {(k["prefix"], v["allows"]) for k, v in rows} == {
        ("10.1.0.0/24", "tcp/80"),
        ("10.1.0.4/32", "nothing"),
    }
    dp.policy.apply(POD_B.endpoint_id, [], 2)
    assert not flags(dp, POD_B) & L.EP_F_PREFIX_POLICY
    assert dp.dump("prefix_policy") == []
    dp.policy.apply(POD_B.endpoint_id, [], 3, prefixes=BLOCK)
    assert dp.remove_endpoint(POD_B.endpoint_id) == 1
    assert dp.prefix_policy.entry_count(POD_B.endpoint_id) == 0
    assert dp.dump("prefix_policy") == []


def test_too_many_port_ranges_write_nothing(dp: Datapath) -> None:
    POD_B.add(dp)
    dp.policy.apply(POD_B.endpoint_id, [], 1, prefixes=BLOCK)
    many = tuple((TCP, 1000 + 2 * i, 0) for i in range(L.PREFIX_POLICY_PORTS + 1))
    with pytest.raises(PolicyBudgetExceeded, match="port ranges"):
        dp.policy.apply(
            POD_B.endpoint_id, [], 2, prefixes=[PrefixRule("10.0.0.0/8", INGRESS, many)]
        )
    assert dp.prefix_policy.entry_count(POD_B.endpoint_id) == 2
    assert dp.endpoints.realized_revision(POD_B.endpoint_id) == 1
