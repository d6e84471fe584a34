"""Benchmark of the ipam service: allocations per second through gRPC with
etcd persistence, with 1 client and with 16 concurrent clients, and the
latency of one Allocate (p50, p99).

Sets up its own etcd (Debian's, on free loopback ports, data in a temporary
folder) and ipam replicas as processes, and stops them by PID at the end.
Clients are threads of this process, each with a blocking gRPC stub.

    python bench/ipam.py [--quick] [--json] [--replicas N] [--allocations N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import tls  # noqa: E402
from harness.etcd import EtcdServer  # noqa: E402
from harness.procs import ServiceProcess  # noqa: E402

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc  # noqa: E402
from flagella.common import pki  # noqa: E402

NODES = ("bench-1", "bench-2", "bench-3", "bench-4")


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_load(addresses: list[str], tag: str, clients: int, count: int) -> dict[str, float]:
    """count Allocate calls (IPv4, one new owner each, spread over the nodes)
    made by clients concurrent callers, each a thread with a blocking stub
    (grpc's threaded client costs less CPU per call than its asyncio one, and
    the load generator shares the machine with what it measures)."""
    # Allocations are the endpoint service's to ask for.
    channels = [tls.session().channel(a, pki.service("endpoint")) for a in addresses]
    for ch in channels:
        grpc.channel_ready_future(ch).result(timeout=10)
    stubs = [ipam_pb2_grpc.IpamServiceStub(ch) for ch in channels]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    ips: list[list[str]] = [[] for _ in range(clients)]
    errors: list[list[str]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def caller(c: int) -> None:
        stub = stubs[c % len(stubs)]
        start.wait()
        for i in range(c, count, clients):
            req = ipam_pb2.AllocateRequest(
                node=NODES[i % len(NODES)],
                owner=ipam_pb2.Owner(container_id=f"{tag}-{i}", ifname="eth0"),
                families=[ipam_pb2.FAMILY_IPV4],
            )
            t0 = time.perf_counter()
            try:
                resp = stub.Allocate(req, timeout=30)
            except grpc.RpcError as exc:
                errors[c].append(f"{exc.code().name}: {exc.details()}")
                continue
            latencies[c].append(time.perf_counter() - t0)
            ips[c].extend(f"{a.node}/{a.ip}" for a in resp.allocations)

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for ch in channels:
        ch.close()
    all_latencies = sorted(x for lat in latencies for x in lat)
    granted = [ip for chunk in ips for ip in chunk]
    failures = [e for chunk in errors for e in chunk]
    if failures:
        print(f"{tag}: {len(failures)} failed calls, e.g. {failures[:3]}", file=sys.stderr)
    if len(set(granted)) != len(granted):
        raise SystemExit(f"duplicate IPs handed out in {tag}!")
    q = statistics.quantiles(all_latencies, n=100, method="inclusive")
    return {
        "allocations": len(all_latencies),
        "errors": sum(len(e) for e in errors),
        "seconds": elapsed,
        "per_s": len(all_latencies) / elapsed,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
    }


async def _setup(address: str) -> None:
    for name in NODES:  # each node registers itself
        async with tls.session().aio_channel(address, pki.node(name)) as ch:
            stub = ipam_pb2_grpc.IpamServiceStub(ch)
            await stub.RegisterNode(ipam_pb2.RegisterNodeRequest(name=name))


async def _count(address: str) -> int:
    async with tls.session().aio_channel(address) as ch:
        stub = ipam_pb2_grpc.IpamServiceStub(ch)
        resp = await stub.ListAllocations(ipam_pb2.ListAllocationsRequest())
        return len(resp.allocations)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer allocations (within 30 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--replicas", type=int, default=1, help="ipam processes (default 1)")
    parser.add_argument("--allocations", type=int, default=0, help="per run (default 10000)")
    args = parser.parse_args()
    count = args.allocations or (2000 if args.quick else 10000)
    single = max(count // 5, 200)

    work = Path(tempfile.mkdtemp(prefix="flagella-bench-ipam-"))
    etcd = EtcdServer(work / "etcd")
    replicas: list[ServiceProcess] = []
    try:
        etcd.start()
        for _ in range(args.replicas):
            proc = ServiceProcess(
                "ipam",
                [
                    "--etcd-endpoints", etcd.endpoint,
                    "--cluster-cidr", "10.0.0.0/8",
                    "--node-mask-size-v4", "16",
                    "--log-level", "warning",
                ],
                log_dir=work,
            )  # fmt: skip
            replicas.append(proc.start())
        for proc in replicas:
            proc.wait_serving()
        addresses = [p.address for p in replicas]
        asyncio.run(_setup(addresses[0]))
        # Warm-up: connections, code paths.
        run_load(addresses, "warmup", 2, 200)
        one = run_load(addresses, "one", 1, single)
        pids = [p.pid for p in replicas]
        assert etcd.proc is not None
        cpu0 = (sum(cpu_seconds(p) for p in pids), cpu_seconds(etcd.proc.pid))
        many = run_load(addresses, "many", 16, count)
        cpu1 = (sum(cpu_seconds(p) for p in pids), cpu_seconds(etcd.proc.pid))
        stored = asyncio.run(_count(addresses[0]))
        expected = 200 + one["allocations"] + many["allocations"]
        if stored != expected:
            raise SystemExit(f"etcd holds {stored} allocations, {expected} were granted")
    finally:
        for proc in replicas:
            proc.stop()
        etcd.cleanup()
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "replicas": args.replicas,
        "allocations_16_clients": int(many["allocations"]),
        "alloc_per_s_1_client": round(one["per_s"], 1),
        "alloc_p50_ms_1_client": round(one["p50_ms"], 2),
        "alloc_p99_ms_1_client": round(one["p99_ms"], 2),
        "alloc_per_s_16_clients": round(many["per_s"], 1),
        "alloc_p50_ms_16_clients": round(many["p50_ms"], 2),
        "alloc_p99_ms_16_clients": round(many["p99_ms"], 2),
        "alloc_p99_ms": round(many["p99_ms"], 2),
        "ipam_cpu_ms_per_alloc": round((cpu1[0] - cpu0[0]) / many["allocations"] * 1000, 3),
        "etcd_cpu_ms_per_alloc": round((cpu1[1] - cpu0[1]) / many["allocations"] * 1000, 3),
        "errors": int(one["errors"] + many["errors"]),
        "duplicates": 0,
        "lost": 0,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"ipam bench: {args.replicas} replica(s), 1 etcd, Allocate (IPv4) over gRPC")
    print(f"{'clients':>8} {'allocations':>12} {'alloc/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for clients, r in ((1, one), (16, many)):
        print(
            f"{clients:>8} {int(r['allocations']):>12} {r['per_s']:>10.0f} "
            f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}"
        )
    print(
        f"CPU per allocation with 16 clients: ipam {result['ipam_cpu_ms_per_alloc']} ms "
        f"(all replicas), etcd {result['etcd_cpu_ms_per_alloc']} ms"
    )
    print(f"errors {result['errors']}, duplicates 0, lost 0 (every granted IP is in etcd)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
