"""Benchmark of the node's DNS proxy: the latency it adds to a pod's DNS
query (p50/p99 through the proxy against the same query straight to the
server, in the same run, from the same pod) and the queries per second one
node's proxy answers, with the datapath's CPU time per query (from
/proc/PID/stat). A real node: etcd and the services as processes, the
datapath in a node netns, a pod through `flagella-cni`, a DNS server of
its own (dnspython) in the outside netns.

    python bench/dns.py [--quick] [--json]

Needs root. Creates its own etcd, processes, namespaces and pin folder,
and removes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.cluster import OUTSIDE_IP, standalone_cluster  # noqa: E402
from harness.cnipods import cni_pod  # noqa: E402
from harness.dns import serve_dns  # noqa: E402
from harness.netns import wait_until  # noqa: E402

from flagella.api.policy.v1 import policy_pb2  # noqa: E402

DNS = OUTSIDE_IP.format(n=101)
NET = DNS.rsplit(".", 1)[0]
POLICY = f"""
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: bench-dns, namespace: shop}}
spec:
  endpointSelector: {{matchLabels: {{app: web}}}}
  egress:
  - toCIDR: [{DNS}/32]
    toPorts: [{{ports: [{{port: "53", protocol: UDP}}]}}]
  - toFQDNs: [{{matchPattern: "*.example.test"}}]
    toPorts: [{{ports: [{{port: "443", protocol: TCP}}]}}]
"""

# In the pod: n sequential UDP queries (latency of each, ms), then `parallel`
# sockets each sending `per_socket` queries one after the other (total s).
CLIENT = r"""
import json, socket, sys, threading, time
import dns.message
server, name, n, parallel, per_socket = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
wire = dns.message.make_query(name, "A").to_wire()
def one(s):
    s.send(wire)
    reply = s.recv(4096)
    assert reply[:2] == wire[:2] and reply[3] & 0x0F == 0, reply
def connected():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.connect((server, 53))
    return s
s = connected()
for _ in range(20):
    one(s)
lat = []
for _ in range(n):
    t = time.perf_counter(); one(s); lat.append((time.perf_counter() - t) * 1000)
def worker():
    w = connected()
    for _ in range(per_socket):
        one(w)
threads = [threading.Thread(target=worker) for _ in range(parallel)]
t = time.perf_counter()
for th in threads: th.start()
for th in threads: th.join()
print(json.dumps({"lat": lat, "seconds": time.perf_counter() - t}))
"""


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its reaped children: none here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_bench(quick: bool) -> dict[str, float]:
    n, parallel, per_socket = (300, 4, 250) if quick else (2000, 4, 2000)
    tmp = Path(tempfile.mkdtemp(prefix="flbench-dns-"))
    figures: dict[str, float] = {}
    loadavg_start = Path("/proc/loadavg").read_text().split()[0]
    with standalone_cluster(tmp) as cluster:
        cluster.start(services=("ipam", "policy", "lb", "endpoint"))
        node = cluster.add_node("bench")
        serve_dns(node.outside, NET)
        pod = cni_pod(cluster, node, "web", {"app": "web"}).ns
        assert node.process is not None
        assert node.process.proc is not None
        pid = node.process.proc.pid

        def measure(tag: str) -> None:
            out = pod.run(
                sys.executable, "-c", CLIENT, DNS, "api.example.test",
                str(n), str(parallel), str(per_socket), timeout=600,
            )  # fmt: skip
            result: dict[str, Any] = json.loads(out.stdout)
            lat = result["lat"]
            figures[f"{tag}_p50_ms"] = statistics.median(lat)
            figures[f"{tag}_p99_ms"] = pct(lat, 99)
            figures[f"{tag}_queries_per_s"] = parallel * per_socket / result["seconds"]

        measure("direct")
        # The same pod's DNS through the proxy from here on.
        cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=POLICY), timeout=10)

        def redirected() -> bool:
            # A query through the proxy teaches api.example.test: its entry appears.
            pod.run(sys.executable, "-c", CLIENT, DNS, "api.example.test", "1", "1", "1")
            listed = cluster.policy().ListFQDNCache(
                policy_pb2.ListFQDNCacheRequest(node="bench"), timeout=10
            )
            return bool(listed.entries)

        if not wait_until(redirected, timeout=30):
            raise RuntimeError("the pod's DNS never went through the proxy")
        cpu = cpu_seconds(pid)
        measure("proxy")
        cpu = cpu_seconds(pid) - cpu
        total = n + 20 + parallel * per_socket  # the warm-up's 20 too
        figures["proxy_cpu_us_per_query"] = cpu / total * 1e6
        figures["added_p50_ms"] = figures["proxy_p50_ms"] - figures["direct_p50_ms"]
        figures["added_p99_ms"] = figures["proxy_p99_ms"] - figures["direct_p99_ms"]
    figures["loadavg_start"] = float(loadavg_start)
    figures["loadavg_end"] = float(Path("/proc/loadavg").read_text().split()[0])
    return figures


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
