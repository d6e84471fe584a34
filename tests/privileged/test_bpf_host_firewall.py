"""The host firewall (host policies) in from_netdev / to_netdev /
from_container / to_container with BPF_PROG_TEST_RUN: the flag that keeps
it out of the way, the host endpoint's policy, conntrack for the host's own
connections, the safety set, and flows with the host as the endpoint."""

from __future__ import annotations

import dataclasses

import pytest
from harness.bpf import POD_A

from flagella.datapath.bpf import Datapath, Direction, DropReason, NodeConfig, PolicyEntry
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.bpf.tables import SafeEntry

pytestmark = pytest.mark.privileged

NODE_IP = "192.168.50.1"
ADMIN_IP = "198.51.100.7"  # inside the admins' CIDR
OTHER_IP = "203.0.113.9"
ETCD_IP = "192.168.50.200"
ADMINS = 16777300  # the CIDR identity of 198.51.100.0/24
INGRESS, EGRESS = Direction.INGRESS, Direction.EGRESS


def host_policy(dp: Datapath, entries: list[PolicyEntry], *, ingress: bool, egress: bool) -> None:
    dp.policy.apply_host(entries)
    cfg = dp.config.read()
    dp.config.write(
        dataclasses.replace(cfg, host_policy=True, host_ingress=ingress, host_egress=egress)
    )


def setup(dp: Datapath) -> None:
    dp.config.write(NodeConfig(node_ip4=NODE_IP))
    dp.ipcache.upsert("198.51.100.0/24", ADMINS)
    POD_A.add(dp)
    dp.policy.apply(POD_A.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)


def to_host(dp: Datapath, src: str, dport: int, **kw: object) -> int:
    return dp.test_run("from_netdev", P.build(src, NODE_IP, dport=dport, **kw)).retval  # type: ignore[arg-type]


def ssh_only_from_admins(dp: Datapath) -> None:
    host_policy(
        dp, [PolicyEntry(ADMINS, INGRESS, protocol=6, port=2222)], ingress=True, egress=False
    )


def test_without_a_host_policy_nothing_is_judged_or_tracked(dp: Datapath) -> None:
    setup(dp)
    assert to_host(dp, OTHER_IP, 2222) == L.TC_ACT_OK
    out = dp.test_run("to_netdev", P.build(NODE_IP, OTHER_IP, sport=40000, dport=443))
    assert out.retval == L.TC_ACT_OK
    assert not [t for t, scope, _ in dp.conntrack.entries() if scope >= L.CT_SCOPE_HOST_OUT]


def test_ingress_allowed_from_one_cidr_only_and_the_drop_is_a_host_flow(dp: Datapath) -> None:
    setup(dp)
    ssh_only_from_admins(dp)
    assert to_host(dp, ADMIN_IP, 2222) == L.TC_ACT_OK
    assert to_host(dp, ADMIN_IP, 22) == L.TC_ACT_SHOT
    assert to_host(dp, OTHER_IP, 2222) == L.TC_ACT_SHOT
    # The admitted connection goes on (conntrack), and so do its replies.
    assert to_host(dp, ADMIN_IP, 2222, flags=P.TCP_ACK) == L.TC_ACT_OK
    reply = P.build(NODE_IP, ADMIN_IP, sport=2222, dport=40000, flags=P.TCP_SYN | P.TCP_ACK)
    assert dp.test_run("to_netdev", reply).retval == L.TC_ACT_OK
    with dp.events() as ev:
        flows = ev.read()
    drops = [f for f in flows if f.type == L.FlowType.DROP]
    assert {(f.src_ip, f.dst_port, f.drop_reason) for f in drops} == {
        (ADMIN_IP, 22, DropReason.POLICY_L4),
        (OTHER_IP, 2222, DropReason.POLICY_L3),
    }
    assert {(f.endpoint_id, f.dst_identity, f.direction) for f in drops} == {
        (L.HOST_EP_ID, L.Identity.HOST, INGRESS)
    }
    allowed = [f for f in flows if f.type == L.FlowType.POLICY_VERDICT]
    assert [(f.src_ip, f.src_identity, f.endpoint_id) for f in allowed] == [
        (ADMIN_IP, ADMINS, L.HOST_EP_ID)
    ]
    # Lowering the flag turns it all off again.
    dp.config.write(dataclasses.replace(dp.config.read(), host_policy=False))
    assert to_host(dp, OTHER_IP, 2222, sport=40001) == L.TC_ACT_OK


def test_the_hosts_own_connections_get_their_replies_under_default_deny(dp: Datapath) -> None:
    setup(dp)
    host_policy(dp, [], ingress=True, egress=False)  # nothing may come in
    out = P.build(NODE_IP, OTHER_IP, sport=40000, dport=443)
    assert dp.test_run("to_netdev", out).retval == L.TC_ACT_OK
    reply = P.build(OTHER_IP, NODE_IP, sport=443, dport=40000, flags=P.TCP_SYN | P.TCP_ACK)
    assert dp.test_run("from_netdev", reply).retval == L.TC_ACT_OK
    # Not a reply: dropped.
    assert to_host(dp, OTHER_IP, 40000, sport=444) == L.TC_ACT_SHOT
    # Egress enforced too: only what the policy allows leaves.
    host_policy(dp, [PolicyEntry(0, EGRESS, protocol=17, port=53)], ingress=True, egress=True)
    dns = P.build(NODE_IP, OTHER_IP, proto=17, sport=5353, dport=53)
    assert dp.test_run("to_netdev", dns).retval == L.TC_ACT_OK
    web = P.build(NODE_IP, OTHER_IP, sport=40002, dport=80)
    assert dp.test_run("to_netdev", web).retval == L.TC_ACT_SHOT
    assert dp.metrics.drops(DropReason.POLICY_L4, EGRESS) == 1


def test_the_safety_set_keeps_the_control_plane_before_policy(dp: Datapath) -> None:
    setup(dp)
    host_policy(dp, [], ingress=True, egress=True)  # nothing in or out
    dp.host_safe.replace(
        {
            SafeEntry(L.SAFE_REMOTE, 2379, L.PROTO_TCP, ETCD_IP),
            SafeEntry(L.SAFE_LOCAL_PORT, 50055),
            SafeEntry(L.SAFE_LOCAL_PORT, 4240),
            SafeEntry(L.SAFE_ANY_PORT, 4240),
        }
    )
    # A connection to etcd established before the policy (no conntrack):
    # both ways pass.
    to_etcd = P.build(NODE_IP, ETCD_IP, sport=41000, dport=2379, flags=P.TCP_ACK)
    assert dp.test_run("to_netdev", to_etcd).retval == L.TC_ACT_OK
    assert to_host(dp, ETCD_IP, 41000, sport=2379, flags=P.TCP_ACK) == L.TC_ACT_OK
    # The control plane calling this datapath, and health probes both ways.
    assert to_host(dp, OTHER_IP, 50055) == L.TC_ACT_OK
    assert to_host(dp, OTHER_IP, 4240) == L.TC_ACT_OK
    probe = P.build(NODE_IP, OTHER_IP, sport=42000, dport=4240)
    assert dp.test_run("to_netdev", probe).retval == L.TC_ACT_OK
    # etcd's port on another address is not in the set.
    assert to_host(dp, OTHER_IP, 41000, sport=2379, flags=P.TCP_ACK) == L.TC_ACT_SHOT
    assert dp.metrics.counter(INGRESS, L.REASON_HOST_SAFETY).packets == 3
    assert dp.metrics.counter(EGRESS, L.REASON_HOST_SAFETY).packets == 2
    with dp.events() as ev:
        safety = [f for f in ev.read() if f.type == L.FlowType.HOST_SAFETY]
    # One flow per new connection (a SYN), with the host as the endpoint.
    assert {(f.dst_port, f.direction, f.endpoint_id) for f in safety} == {
        (50055, INGRESS, L.HOST_EP_ID),
        (4240, INGRESS, L.HOST_EP_ID),
        (4240, EGRESS, L.HOST_EP_ID),
    }
    # Switched off (empty set): the policy alone decides.
    dp.host_safe.replace(set())
    assert to_host(dp, ETCD_IP, 41001, sport=2379, flags=P.TCP_ACK) == L.TC_ACT_SHOT


def test_local_pods_to_the_host_and_back_under_the_host_policy(dp: Datapath) -> None:
    setup(dp)
    host_policy(
        dp,
        [PolicyEntry(POD_A.identity, INGRESS, protocol=6, port=2222)],
        ingress=True,
        egress=True,
    )
    ok = dp.test_run("from_container", P.build(POD_A.ip, NODE_IP, dport=2222))
    assert ok.retval == L.TC_ACT_OK
    # The host answers on the pod's conntrack entry.
    back = P.build(NODE_IP, POD_A.ip, sport=2222, dport=40000, flags=P.TCP_SYN | P.TCP_ACK)
    assert dp.test_run("to_container", back).retval == L.TC_ACT_OK
    denied = dp.test_run("from_container", P.build(POD_A.ip, NODE_IP, sport=40001, dport=22))
    assert denied.retval == L.TC_ACT_SHOT
    # The host's own connection to the pod: its egress allows nothing.
    to_pod = P.build(NODE_IP, POD_A.ip, sport=43000, dport=80)
    assert dp.test_run("to_container", to_pod).retval == L.TC_ACT_SHOT
    with dp.events() as ev:
        drops = [f for f in ev.read() if f.type == L.FlowType.DROP]
    assert {(f.direction, f.src_identity, f.dst_identity, f.endpoint_id) for f in drops} == {
        (INGRESS, POD_A.identity, L.Identity.HOST, L.HOST_EP_ID),
        (EGRESS, L.Identity.HOST, POD_A.identity, L.HOST_EP_ID),
    }
