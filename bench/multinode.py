"""Benchmark of traffic between nodes: cross-node TCP throughput (iperf3)
and request/response latency (1-byte ping-pong on one TCP connection, p50 /
p99) between two pods on two nodes, in native and tunnel mode, side by side
with the kernel doing the same job without flagella (plain routing over the
same kind of veths and underlay; a plain kernel VXLAN with static forwarding
entries), and node-join convergence (a node's registration to its first
packet through to an existing pod).

    python bench/multinode.py [--quick] [--json]

Needs root. Everything runs in network namespaces on one underlay bridge
(tests/harness), with its own etcd and control plane; all is removed at the
end.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.cluster import Cluster, Node, standalone_cluster  # noqa: E402
from harness.netns import Netns  # noqa: E402
from harness.pods import add_pod  # noqa: E402
from harness.underlay import Underlay  # noqa: E402

from flagella.api.ipam.v1 import ipam_pb2  # noqa: E402

PY = sys.executable
# Each flagella path and the kernel path it is compared with.
BASELINE = {"native": "kernel_routing", "tunnel": "kernel_vxlan"}

# A 1-byte echo server (one connection at a time is enough).
RR_SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000)); s.listen(8); print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (b := c.recv(1)):
        c.sendall(b)
    c.close()
"""

# n round trips of one byte; prints p50 and p99 in microseconds.
RR_CLIENT = r"""
import socket, sys, time
host, n = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((host, 7000), timeout=5)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(50):
    s.sendall(b"x"); s.recv(1)
rtts = []
for _ in range(n):
    t = time.perf_counter_ns(); s.sendall(b"x"); s.recv(1)
    rtts.append(time.perf_counter_ns() - t)
rtts.sort()
print(rtts[len(rtts) // 2] / 1000, rtts[min(len(rtts) - 1, len(rtts) * 99 // 100)] / 1000)
"""

# Connects every 20 ms until an answer; prints the wall-clock time of it.
FIRST_CONTACT = r"""
import socket, sys, time
host, deadline = sys.argv[1], time.time() + 60
while time.time() < deadline:
    try:
        s = socket.create_connection((host, 7000), timeout=0.1)
        s.sendall(b"x"); s.recv(1); print(time.time()); sys.exit(0)
    except OSError:
        time.sleep(0.02)
sys.exit(1)
"""


def sh(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout


class Pair:
    """A client and a server pod on two different nodes."""

    def __init__(self, client: Netns, server: Netns, server_ip: str) -> None:
        self.client, self.server, self.server_ip = client, server, server_ip
        for cmd in (["iperf3", "-s"], [PY, "-u", "-c", RR_SERVER]):
            proc = server.popen(*cmd)
            if cmd[0] == PY:
                assert proc.stdout is not None
                proc.stdout.readline()
        time.sleep(0.3)

    def throughput(self, seconds: int) -> float:
        """Gbit/s of one iperf3 run."""
        out = self.client.run(
            "iperf3", "-c", self.server_ip, "-t", str(seconds), "-J", "-O", "1",
            timeout=seconds + 60,
        ).stdout  # fmt: skip
        return float(json.loads(out)["end"]["sum_received"]["bits_per_second"]) / 1e9

    def round_trips(self, n: int) -> tuple[float, float]:
        """(p50 µs, p99 µs) of n 1-byte round trips."""
        rr = self.client.run(PY, "-c", RR_CLIENT, self.server_ip, str(n)).stdout
        p50, p99 = (float(x) for x in rr.split())
        return p50, p99


def kernel_pod(node: Netns, pod: Netns, host_if: str, ip: str, mtu: int) -> None:
    """A pod behind a veth of a node with no flagella: the pod's gateway a
    static neighbour, the node a host route (as flagella lays it out)."""
    node.ip("link", "add", host_if, "mtu", str(mtu), "type", "veth", "peer", "name", "eth0",
            "mtu", str(mtu), "netns", pod.name)  # fmt: skip
    node.ip("link", "set", host_if, "up")
    pod.ip("link", "set", "eth0", "up")
    pod.ip("addr", "add", f"{ip}/32", "dev", "eth0")
    host_mac = json.loads(node.ip("-j", "link", "show", host_if).stdout)[0]["address"]
    pod.ip("route", "add", "169.254.1.1", "dev", "eth0", "scope", "link")
    pod.ip("route", "add", "default", "via", "169.254.1.1", "dev", "eth0")
    pod.ip("neigh", "add", "169.254.1.1", "lladdr", host_mac, "dev", "eth0", "nud", "permanent")
    node.ip("route", "add", f"{ip}/32", "dev", host_if)


def kernel_pairs(cluster: Cluster, underlay: Underlay) -> dict[str, Pair]:
    """Plain routing and a plain VXLAN (static FDB and neighbour entries)
    between two nodes that run no flagella."""
    nss = cluster.nss
    k1, k2 = nss.new("k1"), nss.new("k2")
    ips = {}
    for i, k in ((11, k1), (12, k2)):
        ips[k.name] = underlay.plug(k, i, "up0")[0]
        k.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
    pods = {}
    for k, n in ((k1, 1), (k2, 2)):
        routed, tunneled = nss.new(f"k{n}r"), nss.new(f"k{n}v")
        kernel_pod(k, routed, "kr", f"10.230.{n}.2", 1500)
        kernel_pod(k, tunneled, "kv", f"10.230.{n}.3", 1450)
        pods[n] = (routed, tunneled)
    vx_mac = {}
    for k, n in ((k1, 11), (k2, 12)):
        k.ip("link", "add", "vx0", "type", "vxlan", "id", "42", "dstport", "4789",
             "local", ips[k.name], "dev", "up0", "nolearning")  # fmt: skip
        k.ip("addr", "add", f"10.231.0.{n}/24", "dev", "vx0")
        k.ip("link", "set", "vx0", "up")
        vx_mac[k.name] = json.loads(k.ip("-j", "link", "show", "vx0").stdout)[0]["address"]
    for k, peer, n in ((k1, k2, 2), (k2, k1, 1)):
        k.ip("route", "add", f"10.230.{n}.2/32", "via", ips[peer.name])
        peer_vx = f"10.231.0.{10 + n}"
        k.ip("neigh", "add", peer_vx, "lladdr", vx_mac[peer.name], "dev", "vx0", "nud", "permanent")
        k.run("bridge", "fdb", "append", vx_mac[peer.name], "dst", ips[peer.name], "dev", "vx0")
        k.ip("route", "add", f"10.230.{n}.3/32", "via", peer_vx, "dev", "vx0")
    return {
        "kernel_routing": Pair(pods[1][0], pods[2][0], "10.230.2.2"),
        "kernel_vxlan": Pair(pods[1][1], pods[2][1], "10.230.2.3"),
    }


def pod_ip(cluster: Cluster, node: Node, host: int) -> str:
    """Address host of the node's IPv4 pod CIDR (as ipam gave it)."""
    got = cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=node.name), timeout=10)
    cidr = next(ipaddress.ip_network(c) for c in got.pod_cidrs if ":" not in c)
    return str(cidr[host])


def flagella_nodes(cluster: Cluster, underlay: Underlay, mode: str, first: int) -> list[Node]:
    """Two nodes in mode (underlay hosts first and first + 1), not started.
    The two modes' node pairs share the control plane and never talk to
    each other (a native node has no tunnel device)."""
    nodes = [
        cluster.add_node(
            f"{mode}{i}", underlay=underlay, extra=["--routing-mode", mode], start=False
        )
        for i in (1, 2)
    ]
    assert nodes[0].index == first, nodes[0].index
    return nodes


def flagella_pair(cluster: Cluster, nodes: list[Node], mode: str, first: int) -> Pair:
    """A pod on each of two started nodes in mode."""
    a, b = (
        add_pod(
            cluster,
            node,
            f"{mode[0]}{i}",
            first * 10 + i,
            pod_ip(cluster, node, 10 + i),
            {"app": f"bench-{i}"},
        )
        for i, node in enumerate(nodes)
    )
    return Pair(a.ns, b.ns, b.ip)


def join_convergence(
    cluster: Cluster, underlay: Underlay, target_ip: str, joins: int
) -> dict[str, float]:
    """A node joins (tunnel mode), again and again: registration to the
    first answer from an existing pod, as the joining node's host sees it."""
    node = cluster.add_node("j", underlay=underlay, extra=["--routing-mode", "tunnel"], start=False)
    ipam = cluster.ipam()
    samples = []
    for _ in range(joins):
        contact = node.netns.popen(PY, "-c", FIRST_CONTACT, target_ip)
        cluster.start_datapath(node)
        assert contact.wait(60) == 0, "the joining node never reached the pod"
        assert contact.stdout is not None
        reached = float(contact.stdout.read().split()[-1])
        registered = ipam.GetNode(ipam_pb2.GetNodeRequest(name="j"), timeout=10).registered_at
        samples.append((reached - registered.ToNanoseconds() / 1e9) * 1000)
        assert node.process is not None
        node.process.stop()
        ipam.DeregisterNode(ipam_pb2.DeregisterNodeRequest(name="j"), timeout=10)
        time.sleep(0.5)  # every node has forgotten it
    samples.sort()
    return {
        "join_p50_ms": statistics.median(samples),
        "join_p99_ms": samples[min(len(samples) - 1, len(samples) * 99 // 100)],
        "joins": float(joins),
    }


@contextmanager
def bench_cluster() -> Iterator[tuple[Cluster, Underlay]]:
    with (
        tempfile.TemporaryDirectory(prefix="flbench-mn-") as tmp,
        standalone_cluster(Path(tmp)) as cluster,
    ):
        cluster.start(services=("ipam", "policy", "lb"))
        yield cluster, Underlay(cluster.nss)


def bench(quick: bool) -> dict[str, float]:
    """Every path's pair is up at once and measured in rounds. In a round
    each flagella path is measured right next to its kernel baseline (which
    goes first alternates between rounds), so slow drifts of the machine's
    speed fall on both alike: a comparison is the median over the rounds of
    each round's own ratio. A path's throughput is its best round (other
    load only ever lowers it), its latency percentiles their medians."""
    seconds, round_trips, rounds, joins = (1, 300, 1, 1) if quick else (3, 3000, 5, 10)
    figures: dict[str, float] = {}
    with bench_cluster() as (cluster, underlay):
        modes = {"native": 1, "tunnel": 3}
        nodes = {mode: flagella_nodes(cluster, underlay, mode, i) for mode, i in modes.items()}
        # Every datapath starts (and compiles its programs) at once.
        started = [cluster.start_datapath(n, wait=False) for ns in nodes.values() for n in ns]
        for process in started:
            process.wait_serving(60)
        pairs = {
            mode: flagella_pair(cluster, nodes[mode], mode, i) for mode, i in modes.items()
        } | kernel_pairs(cluster, underlay)
        gbps: dict[str, list[float]] = {name: [] for name in pairs}
        p50s: dict[str, list[float]] = {name: [] for name in pairs}
        p99s: dict[str, list[float]] = {name: [] for name in pairs}
        ratios: dict[str, list[float]] = {f"{m}_vs_{b}": [] for m, b in BASELINE.items()}
        rr_ratios: dict[str, list[float]] = {m: [] for m in BASELINE}
        for i in range(rounds):
            for mode, base in BASELINE.items():
                for name in (mode, base) if i % 2 else (base, mode):
                    gbps[name].append(pairs[name].throughput(seconds))
                    p50, p99 = pairs[name].round_trips(round_trips)
                    p50s[name].append(p50)
                    p99s[name].append(p99)
                ratios[f"{mode}_vs_{base}"].append(gbps[mode][-1] / gbps[base][-1])
                rr_ratios[mode].append(p50s[mode][-1] / p50s[base][-1])
        for name in pairs:
            figures[f"{name}_gbps"] = max(gbps[name])
            figures[f"{name}_gbps_min"] = min(gbps[name])
            figures[f"{name}_rr_p50_us"] = statistics.median(p50s[name])
            figures[f"{name}_rr_p99_us"] = statistics.median(p99s[name])
        for mode, base in BASELINE.items():
            short = base.removeprefix("kernel_")
            figures[f"{mode}_vs_{short}_pct"] = statistics.median(ratios[f"{mode}_vs_{base}"]) * 100
            figures[f"{mode}_vs_{short}_pct_min"] = min(ratios[f"{mode}_vs_{base}"]) * 100
            figures[f"{mode}_rr_p50_vs_{short}_pct"] = statistics.median(rr_ratios[mode]) * 100
        figures |= join_convergence(cluster, underlay, pairs["tunnel"].server_ip, joins)
    return figures


TARGETS = [
    ("native_vs_routing_pct", ">=", 90.0),
    ("tunnel_vs_vxlan_pct", ">=", 90.0),
    ("join_p99_ms", "<=", 1000.0),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer joins")
    ap.add_argument("--json", action="store_true", help="figures as one JSON object")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/multinode.py needs root", file=sys.stderr)
        return 2
    start = time.monotonic()
    figures = bench(args.quick)
    figures["wall_s"] = time.monotonic() - start
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return 0
    print(f"{'figure':<28} {'value':>10}")
    for key in sorted(figures):
        print(f"{key:<28} {figures[key]:>10.2f}")
    print()
    for key, op, bound in TARGETS:
        ok = figures[key] >= bound if op == ">=" else figures[key] <= bound
        print(f"target {key} {op} {bound}: {'met' if ok else 'MISSED'} ({figures[key]:.2f})")
    for mode, base in BASELINE.items():
        pct = figures[f"{mode}_rr_p50_vs_{base.removeprefix('kernel_')}_pct"]
        ok = pct <= 110.0
        print(f"target {mode} rr p50 within 10% of {base}: {'met' if ok else 'MISSED'} "
              f"({pct:.1f} % of it, the median of the rounds' ratios)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
