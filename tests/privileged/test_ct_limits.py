"""Conntrack and policy-map limits (issue 18 item 5).

- A conntrack map far smaller than the flows through it (BPF_PROG_TEST_RUN
  on a private datapath with MapSizes(ct=...)): the LRU map evicts, new
  allowed flows keep working, and whatever an eviction (or a failed insert)
  takes away is judged by policy again: a reply whose entry is gone meets
  the replying side's egress policy and the client's ingress policy, a
  denied flow stays denied. Every packet is forwarded, or dropped with a
  reason counted in the metrics map.
- Real traffic through the real control plane: a backend removed from a
  service under established TCP and UDP flows, and an endpoint whose
  policy grows past the node's policy-map budget (locked down, reported,
  recovered)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration
from harness import tls
from harness.bpf import POD_A, POD_B, private_datapath
from harness.cluster import Cluster, Node
from harness.metrics import value
from harness.net import free_port
from harness.netns import wait_until
from harness.pods import Pod, add_pod

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.datapath.bpf import Datapath, Direction, DropReason, MapSizes, PolicyEntry, Programs
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.bpf.tables import Tuple

pytestmark = pytest.mark.privileged

CLI = str(Path(sys.executable).parent / "flagella")

EGRESS, INGRESS = Direction.EGRESS, Direction.INGRESS
CT_SIZE = 256
DROP_REASONS = {int(r) for r in DropReason if r}
TCP = 6


def run(dp: Datapath, program: str, frame: bytes) -> tuple[int, bytes]:
    out = dp.test_run(program, frame)
    return out.retval, out.data


def drops(dp: Datapath) -> collections.Counter[tuple[int, int]]:
    """Drops by (reason, direction) from the metrics map."""
    return collections.Counter(
        {
            (c.reason, int(c.direction)): c.packets
            for c in dp.metrics.nonzero()
            if c.reason in DROP_REASONS
        }
    )


def test_conntrack_full_evicts_and_never_allows_a_denied_flow(
    require_root: None, bpf_programs: Programs
) -> None:
    with private_datapath(bpf_programs, sizes=MapSizes(ct=CT_SIZE)) as dp:
        assert dp.conntrack.max_entries == CT_SIZE
        assert dp.conntrack.spec.type_name == "lru_hash"
        POD_A.add(dp)
        POD_B.add(dp)
        # A may open TCP 80 to B and accepts nothing; B accepts A on 80 and
        # may open nothing: every reply passes by conntrack alone.
        dp.policy.apply(
            POD_A.endpoint_id, [PolicyEntry(POD_B.identity, EGRESS, protocol=TCP, port=80)], 1
        )
        dp.policy.apply(
            POD_B.endpoint_id, [PolicyEntry(POD_A.identity, INGRESS, protocol=TCP, port=80)], 1
        )

        def connect(sport: int) -> bool:
            """A's SYN through A's egress and B's ingress: both entries."""
            ret, data = run(
                dp, "from_container", P.build(POD_A.ip, POD_B.ip, sport=sport, dport=80)
            )
            if ret != L.TC_ACT_REDIRECT:
                return False
            return run(dp, "to_container", data)[0] == L.TC_ACT_OK

        def reply(sport: int) -> int:
            """B's answer: B's egress side, then (if it passed) A's ingress."""
            frame = P.build(POD_B.ip, POD_A.ip, sport=80, dport=sport, flags=P.TCP_ACK)
            ret, data = run(dp, "from_container", frame)
            return run(dp, "to_container", data)[0] if ret == L.TC_ACT_REDIRECT else ret

        before = drops(dp)
        # Three times the map's size of new allowed connections, each
        # answered: every one works, the LRU map making room.
        flows = range(41000, 41000 + 3 * CT_SIZE)
        answered = [connect(s) and reply(s) == L.TC_ACT_OK for s in flows]
        # Nothing dropped, so no insert failed (it would have counted as
        # CT_INSERT_FAILED: a failed insert drops, it never passes).
        assert answered.count(False) == 0
        assert drops(dp) - before == collections.Counter()
        assert dp.conntrack.count() <= CT_SIZE

        def tracked(s: int) -> bool:
            t = Tuple(POD_A.ip, POD_B.ip, s, 80, TCP)
            return any(dp.conntrack.lookup(t, sc) for sc in (L.CT_SCOPE_EGRESS, L.CT_SCOPE_INGRESS))

        evicted = [s for s in flows if not tracked(s)]
        assert len(evicted) >= len(flows) - CT_SIZE  # two entries a flow, CT_SIZE in all
        # The reply of an evicted connection is no reply any more: B's
        # egress policy judges it as a new connection of B's, and drops it.
        gone = evicted[0]
        base = drops(dp)
        assert reply(gone) == L.TC_ACT_SHOT
        assert drops(dp) - base == collections.Counter({(DropReason.POLICY_L3, EGRESS): 1})
        # With B's egress open, the same packet reaches A, whose ingress
        # policy (nothing allowed) drops it: a lost entry never opens A.
        b_ingress = [PolicyEntry(POD_A.identity, INGRESS, protocol=TCP, port=80)]
        dp.policy.apply(POD_B.endpoint_id, b_ingress, 2, egress_enforced=False)
        base = drops(dp)
        assert reply(evicted[1]) == L.TC_ACT_SHOT
        assert drops(dp) - base == collections.Counter({(DropReason.POLICY_L3, INGRESS): 1})
        dp.policy.apply(POD_B.endpoint_id, b_ingress, 3)

        # A denied flow stays denied while the table churns: A to B on
        # another port, B opening a connection to A.
        base = drops(dp)
        for s in range(42000, 42000 + CT_SIZE):
            assert connect(s)
            denied = P.build(POD_A.ip, POD_B.ip, sport=s, dport=81)
            assert run(dp, "from_container", denied)[0] == L.TC_ACT_SHOT
            into_a = P.build(POD_B.ip, POD_A.ip, sport=s, dport=22)
            assert run(dp, "to_container", into_a)[0] == L.TC_ACT_SHOT
        assert drops(dp) - base == collections.Counter(
            {(DropReason.POLICY_L4, EGRESS): CT_SIZE, (DropReason.POLICY_L3, INGRESS): CT_SIZE}
        )
        # An allowed connection whose entries were evicted is judged again
        # on its next packet, and still allowed: eviction costs a policy
        # lookup, not the connection.
        later = evicted[-1]
        assert not tracked(later)
        ack = P.build(POD_A.ip, POD_B.ip, sport=later, dport=80, flags=P.TCP_ACK)
        ret, data = run(dp, "from_container", ack)
        assert ret == L.TC_ACT_REDIRECT
        assert run(dp, "to_container", data)[0] == L.TC_ACT_OK


# --- real traffic through the real control plane ---

VIP = "10.96.0.40"
BUDGET = 12  # the node's --policy-map-max-entries

# One connected UDP socket (one 5-tuple): its source port first, then one
# datagram per line read from stdin and the first word of its answer (the
# backend's name), or "none".
UDP_CLIENT = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1.0)
s.connect((sys.argv[1], int(sys.argv[2])))
print(s.getsockname()[1], flush=True)
for _ in sys.stdin:
    s.send(b"HELLO")
    try:
        print(s.recv(4096).decode().split()[0], flush=True)
    except OSError:
        print("none", flush=True)
"""

ALLOW_8080 = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web-8080}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""

# Ranges that expand into many policy-map keys: over BUDGET on the node,
# far below the policy service's own budget.
ALLOW_MANY = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web-many}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "9090", protocol: TCP}, {port: "10001", endPort: 10999, protocol: TCP}]}]
"""


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("policy", "lb"))
    return cluster.add_node("n1", extra=["--policy-map-max-entries", str(BUDGET)])


def lb_service(name: str, proto: int, port: int, backends: list[Pod], **kw: Any) -> lb_pb2.Service:
    return lb_pb2.Service(
        name=name,
        frontend=lb_pb2.Frontend(address=VIP, port=port, protocol=proto),  # type: ignore[arg-type]
        type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
        backends=[lb_pb2.Backend(address=b.ip, port=8080) for b in backends],
        **kw,
    )


def ct_rows(cluster: Cluster, node: Node) -> list[datapath_pb2.MapEntry]:
    return list(
        cluster.datapath(node).DumpMap(datapath_pb2.DumpMapRequest(name="ct"), timeout=20).entries
    )


def ct_of(rows: list[datapath_pb2.MapEntry], scope: str, proto: str, **fields: str) -> list[Any]:
    """Conntrack rows of a scope and protocol whose key and value hold fields."""
    return [
        r
        for r in rows
        if r.key["scope"] == scope
        and r.key["protocol"] == proto
        and all({**r.key, **r.value}.get(k) == v for k, v in fields.items())
    ]


def service_entries(rows: list[datapath_pb2.MapEntry], bid: int, proto: str) -> list[Any]:
    return ct_of(rows, "service", proto, backend_id=str(bid))


def translated_to(rows: list[datapath_pb2.MapEntry], ip: str, proto: str) -> list[Any]:
    """The client's entries of connections DNATed to ip (they carry a rev-NAT id)."""
    return [r for r in ct_of(rows, "egress", proto, dst=ip) if r.value["rev_nat_id"] != "0"]


@pytest.mark.integration
def test_removed_backend_and_policy_over_budget(cluster: Cluster, node: Node) -> None:
    client = add_pod(cluster, node, "cl", 1, "10.200.4.2", {"app": "client"})
    pods: list[Pod] = []
    for i in range(2):
        pod = add_pod(cluster, node, f"b{i}", 10 + i, f"10.200.4.{10 + i}", {"app": "web"})
        for proto in ("tcp", "udp"):
            pod.ns.serve(proto, 8080, f"b{i}")
        pods.append(pod)
    check_backend_removal(cluster, node, client, pods)
    check_policy_budget(cluster, node, client, pods)


def check_backend_removal(cluster: Cluster, node: Node, client: Pod, pods: list[Pod]) -> None:
    """A backend taken out of a service under established flows: its
    conntrack and affinity entries go; the same UDP socket's next datagram
    is answered by the live backend; the TCP connection to it is reset (the
    live backend has no such connection and answers RST), not blackholed."""
    lb = cluster.lb()
    names = {p.ip: f"b{i}" for i, p in enumerate(pods)}
    affinity = lb_pb2.SessionAffinity(
        type=lb_pb2.SessionAffinity.TYPE_CLIENT_IP, timeout=Duration(seconds=600)
    )
    tcp = lb.UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=lb_service("default/tcp", lb_pb2.PROTOCOL_TCP, 80, pods)
        ),
        timeout=10,
    ).service
    udp = lb.UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=lb_service(
                "default/udp", lb_pb2.PROTOCOL_UDP, 53, pods, session_affinity=affinity
            )
        ),
        timeout=10,
    ).service
    ids = {b.address: b.id for b in udp.backends}
    tcp_ids = {b.address: b.id for b in tcp.backends}

    udp_client = subprocess.Popen(
        client.ns.cmd(sys.executable, "-u", "-c", UDP_CLIENT, VIP, "53"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert udp_client.stdin is not None
        assert udp_client.stdout is not None
        sport = int(udp_client.stdout.readline())

        def ask() -> str:
            assert udp_client.stdin is not None
            assert udp_client.stdout is not None
            udp_client.stdin.write("\n")
            udp_client.stdin.flush()
            return udp_client.stdout.readline().strip()

        assert wait_until(lambda: ask() != "none")
        first = {ask() for _ in range(5)}
        assert len(first) == 1, first
        assert first <= set(names.values()), first
        [udp_a] = [ip for ip, n in names.items() if n in first]
        [udp_b] = [ip for ip in names if ip != udp_a]

        assert wait_until(lambda: client.ns.request("tcp", VIP, 80, timeout=1) is not None)
        hold = client.ns.stream(VIP, 80, hello=True)
        assert hold.stdout is not None
        held_by = hold.stdout.readline().strip()
        tcp_a = next(ip for ip, n in names.items() if n == held_by)
        assert hold.stdout.readline().startswith("ok ")

        rows = ct_rows(cluster, node)

        assert [r.key["sport"] for r in service_entries(rows, ids[udp_a], "udp")] == [str(sport)]
        assert service_entries(rows, tcp_ids[tcp_a], "tcp")
        assert translated_to(rows, udp_a, "udp")
        assert translated_to(rows, tcp_a, "tcp")
        aff = (
            cluster.datapath(node)
            .DumpMap(datapath_pb2.DumpMapRequest(name="affinity"), timeout=10)
            .entries
        )
        assert [r.value["backend_id"] for r in aff] == [str(ids[udp_a])]

        # Each service loses the backend its flow is on.
        lb.UpsertService(
            lb_pb2.UpsertServiceRequest(
                service=lb_service(
                    "default/udp",
                    lb_pb2.PROTOCOL_UDP,
                    53,
                    [p for p in pods if p.ip == udp_b],
                    session_affinity=affinity,
                )
            ),
            timeout=10,
        )
        lb.UpsertService(
            lb_pb2.UpsertServiceRequest(
                service=lb_service(
                    "default/tcp", lb_pb2.PROTOCOL_TCP, 80, [p for p in pods if p.ip != tcp_a]
                )
            ),
            timeout=10,
        )

        # TCP: cut by a reset from the live backend, well before the
        # stream's 5 s timeout would tell a blackhole.
        hold.wait(timeout=10)
        lines = hold.stdout.read().strip().split("\n")
        assert lines[-1].startswith("fail"), lines[-3:]
        assert "reset" in lines[-1], lines[-3:]
        # UDP: the same socket's next datagrams go to the live backend.
        assert wait_until(lambda: ask() == names[udp_b])
        assert {ask() for _ in range(5)} == {names[udp_b]}
    finally:
        udp_client.kill()
        udp_client.wait()

    rows = ct_rows(cluster, node)
    assert service_entries(rows, ids[udp_a], "udp") == []
    assert service_entries(rows, tcp_ids[tcp_a], "tcp") == []
    assert translated_to(rows, udp_a, "udp") == []
    assert translated_to(rows, tcp_a, "tcp") == []
    # The same 5-tuple, on the live backend now; affinity chose it afresh.
    assert [r.key["sport"] for r in service_entries(rows, ids[udp_b], "udp")] == [str(sport)]
    aff = (
        cluster.datapath(node)
        .DumpMap(datapath_pb2.DumpMapRequest(name="affinity"), timeout=10)
        .entries
    )
    assert [r.value["backend_id"] for r in aff] == [str(ids[udp_b])]


def check_policy_budget(cluster: Cluster, node: Node, client: Pod, pods: list[Pod]) -> None:
    """The endpoint's policy grows past the node's budget: locked down (deny
    all), reported in its status, the node's status, the CLI and a metric;
    the full policy is back once the rules shrink. Both pods have the
    identity the rules select: both are locked down."""
    web = pods[0]
    locked = [p.endpoint_id for p in pods]
    assert node.process is not None
    policy = cluster.policy()
    dp = cluster.datapath(node)
    web.ns.serve("tcp", 9090, "web9090")

    def endpoint() -> datapath_pb2.DatapathEndpoint:
        req = datapath_pb2.GetEndpointRequest(endpoint_id=web.endpoint_id)
        return dp.GetEndpoint(req, timeout=10)

    def reaches(port: int) -> bool:
        return client.ns.request("tcp", web.ip, port, timeout=0.5) is not None

    policy.PutRules(policy_pb2.PutRulesRequest(document=ALLOW_8080), timeout=10)
    assert wait_until(lambda: not reaches(9090))
    assert reaches(8080)
    ep = endpoint()
    assert ep.policy_overflow == ""
    assert 0 < ep.policy_map_entries == ep.policy_map_desired <= BUDGET

    policy.PutRules(policy_pb2.PutRulesRequest(document=ALLOW_MANY), timeout=10)
    assert wait_until(lambda: endpoint().policy_overflow != "")
    ep = endpoint()
    assert f"budget {BUDGET}" in ep.policy_overflow
    assert "locked down" in ep.policy_overflow
    assert ep.policy_map_entries == 0
    assert ep.policy_map_desired > BUDGET
    # Locked down: neither the port allowed before nor what only the new
    # policy allows.
    assert not reaches(8080)
    assert not reaches(9090)
    assert not reaches(10500)
    status = dp.GetStatus(datapath_pb2.GetStatusRequest(), timeout=10)
    assert list(status.policy_overflow_endpoints) == locked
    assert status.policy_map_max_entries == BUDGET
    assert value(node.process.scrape(), "flagella_policy_map_overflow_endpoints") == len(locked)
    cli = status_cli(cluster, node)
    assert cli["policy_lockdowns"] == [{"endpoints": locked, "policy_map_max_entries": BUDGET}]

    # The rules shrink: the full policy again, the report cleared.
    policy.DeleteRule(policy_pb2.DeleteRuleRequest(name="web-many"), timeout=10)
    assert wait_until(lambda: endpoint().policy_overflow == "")
    assert reaches(8080)
    assert not reaches(9090)
    assert (
        list(dp.GetStatus(datapath_pb2.GetStatusRequest(), timeout=10).policy_overflow_endpoints)
        == []
    )
    assert value(node.process.scrape(), "flagella_policy_map_overflow_endpoints") == 0
    assert status_cli(cluster, node)["policy_lockdowns"] == []


def status_cli(cluster: Cluster, node: Node) -> Any:
    """`flagella -o json status` against this node's datapath (ipam and the
    endpoint service are not running here: their rows say DOWN)."""
    closed = f"127.0.0.1:{free_port()}"
    addresses = [
        "--policy-address", cluster.services["policy"].address,
        "--lb-address", cluster.services["lb"].address,
        "--ipam-address", closed,
        "--endpoint-address", closed,
        "--datapath-address", node.address,
    ]  # fmt: skip
    env = {**os.environ, "FLAGELLA_TLS_DIR": str(tls.session().bundle(tls.OPERATOR))}
    out = subprocess.run(
        [CLI, *addresses, "-o", "json", "status"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    return json.loads(out.stdout)
