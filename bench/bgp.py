"""Benchmark of BGP advertisement convergence: the time from a service
change at the lb to the router's table (BIRD 2 peered with every node's
gobgpd), p50/p99, for a LoadBalancer service created (its address held via
every node), its only backend moving to another node under
externalTrafficPolicy Local (the next hop moving), and the service deleted
(withdrawn). The same run times, for each change, when the first node's
own speaker holds the change (its gobgpd's table, GetBgpRoutes): the part
flagella takes (lb, stream, reconcile) against the part BGP takes
(gobgpd -> BIRD). Real processes: etcd, ipam, policy and lb, two node
netns with their datapaths on one underlay, BIRD in a router netns.

    python bench/bgp.py [--quick] [--json]

Needs root, gobgpd and bird2. Creates its own etcd, processes, namespaces and
pin folders, and removes them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.bird import Bird, BirdNeighbor, config  # noqa: E402
from harness.cluster import Cluster, Node, standalone_cluster  # noqa: E402
from harness.netns import wait_until  # noqa: E402
from harness.underlay import Underlay  # noqa: E402

from flagella.api.datapath.v1 import datapath_pb2  # noqa: E402
from flagella.api.lb.v1 import lb_pb2  # noqa: E402

ROUTER_ASN, NODE_ASN = 64512, 65001
POOL = "198.51.100.0/24"


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def policy(router: str) -> lb_pb2.BgpPeeringPolicy:
    p = lb_pb2.BgpPeeringPolicy(name="bench")
    vr = p.virtual_routers.add(local_asn=NODE_ASN, export_pod_cidr=True)
    vr.service_selector.match_labels["advertise"] = "bgp"
    vr.neighbors.add(
        peer_address=router,
        peer_asn=ROUTER_ASN,
        hold_time_seconds=9,
        keep_alive_time_seconds=3,
        connect_retry_time_seconds=1,
    )
    return p


def service(i: int, node: str, *, local: bool) -> lb_pb2.Service:
    svc = lb_pb2.Service(
        name=f"bench/svc-{i}",
        frontend=lb_pb2.Frontend(address=f"10.96.{i // 250}.{i % 250 + 1}", port=80,
                                 protocol=lb_pb2.PROTOCOL_TCP),
        type=lb_pb2.SERVICE_TYPE_NODE_PORT,
        backends=[lb_pb2.Backend(address=f"10.200.250.{i % 250 + 1}", port=8080, node=node)],
        labels={"advertise": "bgp"},
        external_traffic_policy=(
            lb_pb2.TRAFFIC_POLICY_LOCAL if local else lb_pb2.TRAFFIC_POLICY_CLUSTER
        ),
    )  # fmt: skip
    svc.load_balancer.SetInParent()
    return svc


def timed(
    change: Callable[[], str], bird_done: Callable[[str], bool], node_done: Callable[[str], bool]
) -> tuple[float, float]:
    """(seconds to the first node's speaker, seconds to BIRD) of one change,
    polled alternately (a few ms a poll)."""
    start = time.perf_counter()
    prefix = change()
    t_node = t_bird = 0.0
    deadline = start + 20
    while not (t_node and t_bird):
        now = time.perf_counter()
        if now > deadline:
            raise RuntimeError(f"{prefix} did not converge")
        if not t_node and node_done(prefix):
            t_node = time.perf_counter() - start
        if not t_bird and bird_done(prefix):
            t_bird = time.perf_counter() - start
    return t_node, t_bird


def run_bench(quick: bool) -> dict[str, float]:
    n = 5 if quick else 60
    tmp = Path(tempfile.mkdtemp(prefix="flbench-bgp-"))
    figures: dict[str, float] = {}
    loadavg_start = float(Path("/proc/loadavg").read_text().split()[0])
    with standalone_cluster(tmp) as cluster:
        cluster.start(services=("ipam", "policy", "lb"))
        underlay = Underlay(cluster.nss)
        router = cluster.nss.new("rt")
        router_ip, _ = underlay.plug(router, 253, "eth0")
        # Both datapaths start at once (the set-up is most of a quick run).
        nodes = [
            cluster.add_node(f"b{i}", underlay=underlay, extra=["--health-port", "0"], start=False)
            for i in (1, 2)
        ]
        starting = [cluster.start_datapath(node, wait=False) for node in nodes]
        for proc in starting:
            proc.wait_serving(120)
        bird = Bird(router, tmp / "bird").start(
            config(
                router_ip,
                ROUTER_ASN,
                [BirdNeighbor(n.name, n.ip, NODE_ASN) for n in nodes],
                log=tmp / "bird" / "bird.log",
                hold_time=9,
                keepalive=3,
            )
        )
        try:
            figures.update(measure(cluster, nodes, bird, router_ip, n))
        finally:
            bird.stop()
            for node in nodes:
                kill_gobgpd(node)
    figures["loadavg_start"] = loadavg_start
    figures["loadavg_end"] = float(Path("/proc/loadavg").read_text().split()[0])
    return figures


def kill_gobgpd(node: Node) -> None:
    """What a datapath stopped by signal left (none when it stopped cleanly)."""
    try:
        pid = int(json.loads((node.state_dir / "bgp" / "gobgpd.pid").read_text())["pid"])
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass


def measure(
    cluster: Cluster, nodes: list[Node], bird: Bird, router_ip: str, n: int
) -> dict[str, float]:
    lb = cluster.lb()
    lb.UpsertLbIpPool(
        lb_pb2.UpsertLbIpPoolRequest(
            pool=lb_pb2.LbIpPool(name="bench", blocks=[lb_pb2.LbIpBlock(cidr=POOL)])
        ),
        timeout=10,
    )
    lb.UpsertBgpPeeringPolicy(
        lb_pb2.UpsertBgpPeeringPolicyRequest(policy=policy(router_ip)), timeout=10
    )
    if not wait_until(lambda: bird.established() == {x.name for x in nodes}, timeout=30):
        raise RuntimeError(f"sessions not established: {bird.protocols()}")
    first = cluster.datapath(nodes[0])
    local = datapath_pb2.GetBgpRoutesRequest(
        table=datapath_pb2.GetBgpRoutesRequest.TABLE_LOCAL, family="ipv4"
    )

    def on_node(prefix: str) -> set[str]:
        return {
            r.prefix for r in first.GetBgpRoutes(local, timeout=10).routes if not r.peer_address
        }

    def via(prefix: str) -> set[str]:
        out = bird.birdc("show", "route", prefix, check=False)
        return {line.split("via ")[1].split()[0] for line in out.splitlines() if "via " in line}

    ips = {x.ip for x in nodes}
    # Whether the lb keeps externalTrafficPolicy (issue 22's lbext work):
    # without it no advertisement follows a backend, and no move is timed.
    probe = lb.UpsertService(
        lb_pb2.UpsertServiceRequest(service=service(9999, nodes[0].name, local=True)), timeout=10
    ).service
    local_kept = probe.external_traffic_policy == lb_pb2.TRAFFIC_POLICY_LOCAL
    lb.DeleteService(lb_pb2.DeleteServiceRequest(name=probe.name), timeout=10)
    if not local_kept:
        print("the lb does not keep externalTrafficPolicy: moves not timed", file=sys.stderr)
    create: list[tuple[float, float]] = []
    move: list[tuple[float, float]] = []
    delete: list[tuple[float, float]] = []
    for i in range(n):
        # The service's address, once created.
        prefix: list[str] = []

        def created(i: int = i, prefix: list[str] = prefix) -> str:
            got = lb.UpsertService(
                lb_pb2.UpsertServiceRequest(service=service(i, nodes[0].name, local=False)),
                timeout=10,
            )
            prefix.append(f"{got.service.load_balancer.ingress[0]}/32")
            return prefix[0]

        create.append(timed(created, lambda p: via(p) == ips, lambda p: p in on_node(p)))

        def moved(i: int = i, prefix: list[str] = prefix) -> str:
            # Local, its backend on the second node: the first withdraws.
            lb.UpsertService(
                lb_pb2.UpsertServiceRequest(service=service(i, nodes[1].name, local=True)),
                timeout=10,
            )
            return prefix[0]

        if local_kept:
            move.append(
                timed(moved, lambda p: via(p) == {nodes[1].ip}, lambda p: p not in on_node(p))
            )

        def deleted(i: int = i, prefix: list[str] = prefix) -> str:
            lb.DeleteService(lb_pb2.DeleteServiceRequest(name=f"bench/svc-{i}"), timeout=10)
            return prefix[0]

        delete.append(timed(deleted, lambda p: not via(p), lambda p: p not in on_node(p)))
    out: dict[str, float] = {"changes_each": float(n)}
    for name, samples in (("create", create), ("move", move), ("delete", delete)):
        if not samples:
            continue
        node_s = [a for a, _ in samples]
        bird_s = [b for _, b in samples]
        out[f"{name}_to_node_p50_ms"] = statistics.median(node_s) * 1000
        out[f"{name}_to_node_p99_ms"] = pct(node_s, 99) * 1000
        out[f"{name}_to_router_p50_ms"] = statistics.median(bird_s) * 1000
        out[f"{name}_to_router_p99_ms"] = pct(bird_s, 99) * 1000
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (within 30 s)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    figures = run_bench(args.quick)
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in figures.items()}))
        return 0
    print(f"{'figure':<28} {'value':>10}")
    for k, v in figures.items():
        print(f"{k:<28} {v:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
