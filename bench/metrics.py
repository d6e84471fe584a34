"""Benchmark of the datapath's /metrics: the time a scrape takes with 1,000
endpoints' worth of state (endpoint and policy map entries written through
the datapath's own writers, 1,000 endpoint records, their regenerations,
conntrack entries after a GC pass, peer nodes), over HTTP from the real
metrics endpoint; and, for comparison, what walking every map to count its
entries (how `flagella status` got map pressure before) costs.

    python bench/metrics.py [--quick] [--json]

Needs root (BPF maps). Pins its maps under a folder of its own and removes
it; no network namespace, no traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
import urllib.request
import uuid

from flagella.common.metrics import Metrics, MetricsServer
from flagella.datapath.bpf import Datapath, PolicyEntry, Tuple
from flagella.datapath.bpf.layout import Direction, Verdict
from flagella.datapath.bpf.tables import ct_key, monotonic_ns
from flagella.datapath.config import DatapathConfig
from flagella.datapath.health import PeerHealth
from flagella.datapath.metrics import DatapathCollector
from flagella.datapath.service import DatapathService
from flagella.datapath.state import EndpointRecord
from flagella.datapath.telemetry import SCOPES

ENDPOINTS = 1000
POLICY_ENTRIES = 20  # per endpoint
PEERS = 10


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def fill(svc: DatapathService, dp: Datapath, endpoints: int, ct_entries: int) -> None:
    """The state of a node with that many endpoints, written as the
    datapath writes it."""
    for i in range(endpoints):
        ep = i + 1
        ip = f"10.210.{i // 250}.{i % 250 + 1}"
        dp.endpoints.upsert(
            ep, [ip], ifindex=100 + i, identity=1000 + i, mac="02:00:00:00:00:01",
            node_mac="02:00:00:00:00:02",
        )  # fmt: skip
        dp.ipcache.upsert(f"{ip}/32", 1000 + i)
        entries = [
            PolicyEntry(identity=2000 + j, direction=Direction.INGRESS, verdict=Verdict.ALLOW,
                        protocol=6, port=8000 + j)
            for j in range(POLICY_ENTRIES)
        ]  # fmt: skip
        dp.policy.apply(ep, entries, 1, ingress_enforced=True, egress_enforced=False)
        svc.endpoints[ep] = EndpointRecord(
            endpoint_id=ep, container_id=f"bench{i}", netns_path=f"/run/netns/b{i}",
            ifname="eth0", host_ifname=f"lxc{ep}", host_ifindex=100 + i, host_mac="",
            mac="", addresses=[f"{ip}/32"], identity=1000 + i, mtu=1500,
        )  # fmt: skip
        for scope in SCOPES:
            svc.telemetry.regeneration.labels(scope).observe(0.001 * (1 + i % 7))
        svc.telemetry.policy_implemented(time.time() - 0.01)
    # Conntrack entries, half of them expired, then a GC pass as the
    # datapath's GC task runs it.
    now = monotonic_ns()
    pairs = []
    for i in range(ct_entries):
        t = Tuple(
            f"10.210.{i % 4}.1", f"10.211.{i // 60000}.{i % 250 + 1}", 1024 + i % 60000, 80, 6
        )
        e = dp.conntrack.value_type()
        e.expires = now + (10**12 if i % 2 else -1)
        pairs.append((ct_key(t, 0), e))
    dp.conntrack.update_batch(pairs)
    start = time.perf_counter()
    stats = dp.gc()
    svc.telemetry.gc_done(time.perf_counter() - start, stats.ct_alive, stats.ct_deleted)
    svc.health.peers = {
        f"node{i}": PeerHealth(f"node{i}", f"10.0.0.{i + 1}", i % 5 != 0, 0.0003, "", time.time())
        for i in range(PEERS)
    }


async def scrape_times(metrics: Metrics, n: int) -> tuple[list[float], int]:
    server = MetricsServer(metrics, "127.0.0.1:0")
    await server.start()
    url = f"http://127.0.0.1:{server.port}/metrics"

    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=10) as r:
            body: bytes = r.read()
            return body

    loop = asyncio.get_running_loop()
    times = []
    size = 0
    try:
        await loop.run_in_executor(None, get)  # warm-up: the first request's imports
        for _ in range(n):
            t = time.perf_counter()
            size = len(await loop.run_in_executor(None, get))
            times.append((time.perf_counter() - t) * 1000)
    finally:
        await server.stop()
    return times, size


def run(quick: bool) -> dict[str, float]:
    pin = f"/sys/fs/bpf/flbench-metrics-{uuid.uuid4().hex[:6]}"
    dp = Datapath.load(pin, load_programs=False)  # the maps alone
    try:
        metrics = Metrics("datapath")
        svc = DatapathService(DatapathConfig(bpf_root=pin), metrics.registry)
        svc._bpf = dp  # the maps without start(): no netdev, no streams
        metrics.registry.register(DatapathCollector(svc))
        fill(svc, dp, ENDPOINTS, 20000 if quick else 100000)
        times, size = asyncio.run(scrape_times(metrics, 20 if quick else 100))
        walks = []
        for _ in range(3 if quick else 10):
            t = time.perf_counter()
            for m in dp.maps.values():
                m.count()
            walks.append((time.perf_counter() - t) * 1000)
        return {
            "endpoints": ENDPOINTS,
            "policy_entries": dp.policy.stats.entries or 0,
            "ct_entries_alive": dp.conntrack.stats.entries or 0,
            "scrape_p50_ms": statistics.median(times),
            "scrape_p99_ms": pct(times, 99),
            "scrape_bytes": size,
            "walk_all_maps_p50_ms": statistics.median(walks),
        }
    finally:
        dp.close()
        shutil.rmtree(pin, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer entries and scrapes (under 30 s)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/metrics.py needs root", file=sys.stderr)
        return 2
    figures = run(args.quick)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return 0
    print(f"{'figure':<32} {'value':>12}")
    for key in sorted(figures):
        print(f"{key:<32} {figures[key]:>12.2f}")
    ok = figures["scrape_p99_ms"] < 100
    print(
        f"\ntarget scrape_p99_ms < 100: {'met' if ok else 'MISSED'} ({figures['scrape_p99_ms']:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
