"""Benchmark of the datapath: ns per packet of the main BPF paths (via
bench/datapath_bpf.py), SetupEndpoint/TeardownEndpoint latency through the
real datapath process over gRPC, and TCP throughput pod to pod (iperf3) with
the programs attached against the same veth pair routed by the kernel alone.

    python bench/datapath.py [--quick] [--json]

Needs root. Creates its own network namespaces, pin folders and processes
and removes them; no traffic leaves those namespaces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import tls

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.common import pki

HERE = Path(__file__).resolve().parent
PY = sys.executable


def sh(*args: str, check: bool = True) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=120).stdout


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


@contextlib.contextmanager
def netns(names: list[str]) -> Iterator[list[str]]:
    try:
        for n in names:
            sh("ip", "netns", "add", n)
            sh("ip", "-n", n, "link", "set", "lo", "up")
        yield names
    finally:
        for n in names:
            sh("ip", "netns", "del", n, check=False)


def bpf_figures(quick: bool) -> dict[str, float]:
    out = sh(PY, str(HERE / "datapath_bpf.py"), "--json", *(["--quick"] if quick else []))
    figures: dict[str, float] = json.loads(out)
    return figures


def setup_latency(quick: bool, tag: str) -> dict[str, float]:
    n = 20 if quick else 60
    node = f"flbench-{tag}-node"
    pods = [f"flbench-{tag}-p{i}" for i in range(n)]
    tmp = Path(tempfile.mkdtemp(prefix="flbench-"))
    sock = tmp / "dp.sock"
    pin = f"/sys/fs/bpf/flbench-{tag}"
    proc = None
    with netns([node, *pods]):
        try:
            proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{node}", PY, "-m", "flagella.datapath",
                 "--listen", f"unix:{sock}", "--node-name", "bench", "--bpf-root", pin,
                 "--state-dir", str(tmp / "state"), "--log-level", "warning",
                 *tls.session().args(pki.node("bench"))],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            # Endpoints are set up by the endpoint service.
            with tls.session().channel(f"unix:{sock}", pki.service("endpoint")) as ch:
                stub = datapath_pb2_grpc.DatapathServiceStub(ch)
                deadline = time.monotonic() + 60
                while True:
                    try:
                        stub.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=1)
                        break
                    except grpc.RpcError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
                adds, dels = [], []
                for i, pod in enumerate(pods):
                    t = time.perf_counter()
                    stub.SetupEndpoint(
                        datapath_pb2.SetupEndpointRequest(
                            endpoint_id=i + 1, container_id=f"bench{i}", netns_path=f"/run/netns/{pod}",
                            ifname="eth0", addresses=[f"10.201.{i // 250}.{i % 250 + 1}/32"],
                            identity=1000 + i, mtu=1500,
                        ),
                        timeout=30,
                    )  # fmt: skip
                    adds.append((time.perf_counter() - t) * 1000)
                for i in range(n):
                    t = time.perf_counter()
                    stub.TeardownEndpoint(
                        datapath_pb2.TeardownEndpointRequest(endpoint_id=i + 1), timeout=30
                    )
                    dels.append((time.perf_counter() - t) * 1000)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
            shutil.rmtree(pin, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "setup_endpoint_p50_ms": statistics.median(adds),
        "setup_endpoint_p99_ms": pct(adds, 99),
        "teardown_endpoint_p50_ms": statistics.median(dels),
        "teardown_endpoint_p99_ms": pct(dels, 99),
    }


ATTACH = r"""
import sys
from flagella.datapath.bpf import Datapath
pin, a_if, b_if = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pods = [(1, "10.202.0.1", a_if, sys.argv[4], sys.argv[5]), (2, "10.202.0.2", b_if, sys.argv[6], sys.argv[7])]
dp = Datapath.load(pin)
for ep, ip, ifindex, mac, node_mac in pods:
    dp.endpoints.upsert(ep, [ip], ifindex=ifindex, identity=1000 + ep, mac=mac, node_mac=node_mac)
    dp.policy.apply(ep, [], 1, ingress_enforced=False, egress_enforced=False)
    dp.attach(ifindex)
dp.close()
"""


def iperf(client: str, server_ip: str, seconds: int) -> float:
    out = sh("nsenter", f"--net=/run/netns/{client}", "iperf3", "-c", server_ip, "-t", str(seconds),
             "-J", "-O", "1")  # fmt: skip
    return float(json.loads(out)["end"]["sum_received"]["bits_per_second"]) / 1e9


def throughput(quick: bool, tag: str) -> dict[str, float]:
    seconds = 2 if quick else 5
    node, a, b = f"flbench-{tag}-tn", f"flbench-{tag}-ta", f"flbench-{tag}-tb"
    pin = f"/sys/fs/bpf/flbench-{tag}-t"
    with netns([node, a, b]):
        try:
            sh("ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            macs = {}
            for pod, host, ip in ((a, "lxca", "10.202.0.1"), (b, "lxcb", "10.202.0.2")):
                sh(
                    "ip",
                    "-n",
                    node,
                    "link",
                    "add",
                    host,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    pod,
                )
                sh("ip", "-n", node, "link", "set", host, "up")
                sh("ip", "-n", pod, "link", "set", "eth0", "up")
                sh("ip", "-n", pod, "addr", "add", f"{ip}/32", "dev", "eth0")
                host_mac = json.loads(sh("ip", "-n", node, "-j", "link", "show", host))[0][
                    "address"
                ]
                pod_mac = json.loads(sh("ip", "-n", pod, "-j", "link", "show", "eth0"))[0][
                    "address"
                ]
                macs[host] = (host_mac, pod_mac)
                sh("ip", "-n", pod, "route", "add", "169.254.1.1", "dev", "eth0", "scope", "link")
                sh("ip", "-n", pod, "route", "add", "default", "via", "169.254.1.1", "dev", "eth0")
                sh(
                    "ip",
                    "-n",
                    pod,
                    "neigh",
                    "add",
                    "169.254.1.1",
                    "lladdr",
                    host_mac,
                    "dev",
                    "eth0",
                    "nud",
                    "permanent",
                )
                sh("ip", "-n", node, "route", "add", f"{ip}/32", "dev", host)
                sh(
                    "ip",
                    "-n",
                    node,
                    "neigh",
                    "add",
                    ip,
                    "lladdr",
                    pod_mac,
                    "dev",
                    host,
                    "nud",
                    "permanent",
                )
            server = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{b}", "iperf3", "-s"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                time.sleep(0.5)
                base = iperf(a, "10.202.0.2", seconds)
                idx = {
                    h: json.loads(sh("ip", "-n", node, "-j", "link", "show", h))[0]["ifindex"]
                    for h in ("lxca", "lxcb")
                }
                sh("nsenter", f"--net=/run/netns/{node}", PY, "-c", ATTACH, pin,
                   str(idx["lxca"]), str(idx["lxcb"]), macs["lxca"][1], macs["lxca"][0],
                   macs["lxcb"][1], macs["lxcb"][0])  # fmt: skip
                with_bpf = iperf(a, "10.202.0.2", seconds)
            finally:
                server.kill()
                server.wait(10)
        finally:
            shutil.rmtree(pin, ignore_errors=True)
    return {
        "tcp_gbps_kernel_routing": base,
        "tcp_gbps_bpf": with_bpf,
        "tcp_overhead_pct": (base - with_bpf) / base * 100,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (under 30 s)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/datapath.py needs root", file=sys.stderr)
        return 2
    tag = uuid.uuid4().hex[:6]
    figures: dict[str, float] = {}
    figures.update(bpf_figures(args.quick))
    figures.update(setup_latency(args.quick, tag))
    figures.update(throughput(args.quick, tag))
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return 0
    print(f"{'figure':<44} {'value':>12}")
    for key in sorted(figures):
        print(f"{key:<44} {figures[key]:>12.2f}")
    targets = [
        ("allowed_ct_hit_ns_per_pkt", "<", 300),
        ("setup_endpoint_p50_ms", "<", 30),
        ("tcp_overhead_pct", "<", 10),
    ]
    print()
    for key, op, bound in targets:
        if key in figures:
            ok = figures[key] < bound
            print(f"target {key} {op} {bound}: {'met' if ok else 'MISSED'} ({figures[key]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
