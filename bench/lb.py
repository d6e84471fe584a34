"""Benchmark of the lb service.

1. Maglev table build time (pure Python) for M = 16,381 and 65,521 with 10,
   100 and 1,000 backends (equal weights, and 100 weighted ones).
2. Upsert latency: one service upserted through gRPC into etcd until its
   event arrives on a WatchServices stream (the datapath's input), on an
   idle service, many times.
3. Bulk: N services (10,000; 2,000 with --quick) upserted through gRPC with
   64 UpsertService calls in flight, until every one has arrived on a
   WatchServices stream opened before the first upsert; then N more by
   UpsertServices, 500 per call, two calls in flight.
4. With the datapath (as root): time from an upsert that swaps a service's
   backend until a client pod's connections reach the new backend, and
   the time until N services (10,000; 1,000 with --quick) upserted into
   the lb by UpsertServices (500 per call, requests built beforehand) are
   programmed into a node's BPF maps. A node netns with its
   own datapath, pods as netns; all removed at the end.

It starts its own etcd (Debian's) and lb process on free loopback ports and
removes them at the end. The datapath part also reports the services/s
rate and the CPU per service of the lb, policy (which follows the services
for toServices), etcd and the datapath over the
interval (/proc/<pid>/stat); with BENCH_LB_PY_SPY=<dir>, py-spy profiles of
the lb and the datapath over it. Usage:
python bench/lb.py [--quick] [--json] [--services N] [--no-datapath | --datapath-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness.cluster import standalone_cluster
from harness.etcd import EtcdServer
from harness.pods import add_pod
from harness.procs import ServiceProcess

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.api.lb.v1 import lb_pb2_grpc
from flagella.lb.maglev import (
    DEFAULT_SEED,
    MaglevBackend,
    backend_key,
    lookup_table,
    parse_seed,
)


def bench_maglev(quick: bool) -> dict[str, float]:
    seed = parse_seed(DEFAULT_SEED)
    out: dict[str, float] = {}
    cases: list[tuple[int, int, bool]] = [
        (m, n, False) for m in (16381, 65521) for n in (10, 100, 1000)
    ]
    cases += [(16381, 100, True), (65521, 100, True)]
    for m, n, weighted in cases:
        backends = [
            MaglevBackend(
                backend_key(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8080, "TCP"),
                i + 1,
                (i * 37) % 100 + 1 if weighted else 1,
            )
            for i in range(n)
        ]
        runs = 3 if quick else 9
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            lookup_table(backends, m, seed)
            times.append(time.perf_counter() - t0)
        key = f"maglev_m{m}_b{n}{'_weighted' if weighted else ''}_build_ms"
        out[key] = round(statistics.median(times) * 1e3, 2)
        out[key.replace("_build_ms", "_build_min_ms")] = round(min(times) * 1e3, 2)
    return out


def svc(i: int, backends: int = 3) -> pb.Service:
    s = pb.Service(
        name=f"bench/s{i}",
        frontend=pb.Frontend(
            address=f"10.{100 + i // 65536}.{i // 256 % 256}.{i % 256}",
            port=80,
            protocol=pb.PROTOCOL_TCP,
        ),
    )
    for j in range(backends):
        s.backends.add(address=f"10.{200 + j}.{i // 256 % 256}.{i % 256}", port=8080)
    return s


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench_service(
    proc: ServiceProcess, pid: int, n: int, latency_runs: int
) -> dict[str, float]:
    async with proc.aio_channel() as ch:
        stub = lb_pb2_grpc.LoadBalancerServiceStub(ch)
        arrived: dict[str, float] = {}
        synced = asyncio.Event()
        waiters: dict[str, asyncio.Future[float]] = {}

        async def follow() -> None:
            async for ev in stub.WatchServices(pb.WatchServicesRequest()):
                now = time.perf_counter()
                if ev.kind == pb.ServiceEvent.KIND_SYNCED:
                    synced.set()
                elif ev.kind == pb.ServiceEvent.KIND_UPSERT:
                    name = ev.service.name
                    arrived.setdefault(name, now)
                    fut = waiters.pop(name, None)
                    if fut is not None and not fut.done():
                        fut.set_result(now)

        watcher = asyncio.create_task(follow())

        async def all_arrived(wanted: set[str]) -> float:
            """When the last of wanted arrived on the stream (waits for it)."""
            deadline = time.monotonic() + 120
            while not wanted <= arrived.keys():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{len(wanted - arrived.keys())} services never arrived")
                await asyncio.sleep(0.01)
            return max(arrived[x] for x in wanted)

        await synced.wait()

        # Upsert -> event on the stream, one at a time on an idle service.
        latencies = []
        for i in range(latency_runs):
            s = svc(1_000_000 + i)
            fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            waiters[s.name] = fut
            t0 = time.perf_counter()
            await stub.UpsertService(pb.UpsertServiceRequest(service=s))
            t_ack = time.perf_counter()
            t_event = await asyncio.wait_for(fut, 30)
            latencies.append((t_ack - t0, t_event - t0))

        # Bulk: n services, 64 in flight, until all are on the stream.
        names = {f"bench/s{i}" for i in range(n)}
        sent: dict[str, float] = {}
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                s = svc(i)
                sent[s.name] = time.perf_counter()
                await stub.UpsertService(pb.UpsertServiceRequest(service=s), timeout=60)

        cpu0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(64)))
        t_acked = time.perf_counter()
        t_all = await all_arrived(names)
        lb_cpu_ms = (cpu_seconds(pid) - cpu0) * 1e3 / n
        delays = sorted(arrived[x] - sent[x] for x in names)

        # The same number again through UpsertServices, BATCH per call, two
        # calls in flight, until all are on the stream.
        first = 200_000
        batch_names = {f"bench/s{i}" for i in range(first, first + n)}
        sem = asyncio.Semaphore(2)

        async def batch(start: int) -> None:
            async with sem:
                await stub.UpsertServices(
                    pb.UpsertServicesRequest(
                        services=[svc(i) for i in range(start, min(start + BATCH, first + n))]
                    ),
                    timeout=120,
                )

        cpu0 = cpu_seconds(pid)
        tb = time.perf_counter()
        await asyncio.gather(*(batch(s) for s in range(first, first + n, BATCH)))
        tb_acked = time.perf_counter()
        tb_all = await all_arrived(batch_names)
        batch_cpu_ms = (cpu_seconds(pid) - cpu0) * 1e3 / n
        watcher.cancel()

        # A fresh stream's snapshot of everything.
        t1 = time.perf_counter()
        count = 0
        async for ev in stub.WatchServices(pb.WatchServicesRequest()):
            if ev.kind == pb.ServiceEvent.KIND_UPSERT:
                count += 1
            elif ev.kind == pb.ServiceEvent.KIND_SYNCED:
                break
        t_snapshot = time.perf_counter() - t1

    return {
        "upsert_ack_p50_ms": round(statistics.median(a for a, _ in latencies) * 1e3, 2),
        "upsert_to_watch_event_p50_ms": round(statistics.median(e for _, e in latencies) * 1e3, 2),
        "upsert_to_watch_event_max_ms": round(max(e for _, e in latencies) * 1e3, 2),
        "bulk_services": n,
        "bulk_all_acked_s": round(t_acked - t0, 2),
        "bulk_all_on_watch_s": round(t_all - t0, 2),
        "bulk_upserts_per_s": round(n / (t_all - t0), 1),
        "bulk_upsert_to_watch_p50_ms": round(delays[len(delays) // 2] * 1e3, 1),
        "bulk_upsert_to_watch_p99_ms": round(delays[int(len(delays) * 0.99)] * 1e3, 1),
        "bulk_lb_cpu_per_service_ms": round(lb_cpu_ms, 2),
        "batch_all_acked_s": round(tb_acked - tb, 2),
        "batch_all_on_watch_s": round(tb_all - tb, 2),
        "batch_upserts_per_s": round(n / (tb_all - tb), 1),
        "batch_lb_cpu_per_service_ms": round(batch_cpu_ms, 2),
        "snapshot_services": count,
        "snapshot_stream_s": round(t_snapshot, 2),
    }


# Services per UpsertServices call.
BATCH = 500


def dp_service(name: str, vip: str, backends: list[str]) -> pb.Service:
    return pb.Service(
        name=name,
        frontend=pb.Frontend(address=vip, port=80, protocol=pb.PROTOCOL_TCP),
        type=pb.SERVICE_TYPE_CLUSTER_IP,
        algorithm=pb.ALGORITHM_RANDOM,
        backends=[pb.Backend(address=b, port=8080) for b in backends],
    )


def start_py_spy(pids: dict[str, int]) -> list[subprocess.Popen[bytes]]:
    """With BENCH_LB_PY_SPY=<dir>: a py-spy flame graph of each process
    (lb, datapath) while the bulk is programmed (py-spy must be installed)."""
    folder = os.environ.get("BENCH_LB_PY_SPY")
    if not folder:
        return []
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    args = ["--format", "raw", "--nonblocking", "-o", f"{folder}/"]
    spies = []
    for name in ("lb", "datapath"):
        if pids.get(name):
            spies.append(
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(pids[name]),
                        "--rate",
                        "200",
                        *args[:-1],
                        f"{args[-1]}{name}.txt",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    time.sleep(1)  # attached before the first upsert
    return spies


def stop_py_spy(spies: list[subprocess.Popen[bytes]]) -> None:
    for p in spies:
        p.send_signal(signal.SIGINT)
    for p in spies:
        p.wait(30)


def bench_datapath(tmp: Path, quick: bool, n: int) -> dict[str, Any]:
    """Upsert-to-traffic time and N services programmed into a node's maps."""
    out: dict[str, Any] = {}
    with standalone_cluster(tmp) as cluster:
        cluster.start(services=("policy", "lb"))
        node = cluster.add_node("bench")
        client = add_pod(cluster, node, "cl", 1, "10.203.0.2", {"app": "client"})
        backends = [
            add_pod(cluster, node, f"b{i}", 10 + i, f"10.203.0.{10 + i}", {"app": "web"})
            for i in range(2)
        ]
        for i, b in enumerate(backends):
            b.ns.serve("tcp", 8080, f"b{i}")
        lb = cluster.lb()
        vip = "10.97.255.1"
        lb.UpsertService(
            pb.UpsertServiceRequest(service=dp_service("bench/swap", vip, [backends[0].ip])),
            timeout=10,
        )
        deadline = time.monotonic() + 30
        while (client.ns.request("tcp", vip, 80, timeout=1) or "").split()[:1] != ["b0"]:
            if time.monotonic() > deadline:
                raise RuntimeError("service never reached b0")
        swaps = []
        for k in range(5 if quick else 15):
            target = (k + 1) % 2
            t0 = time.perf_counter()
            lb.UpsertService(
                pb.UpsertServiceRequest(
                    service=dp_service("bench/swap", vip, [backends[target].ip])
                ),
                timeout=10,
            )
            while (client.ns.request("tcp", vip, 80, timeout=1) or "").split()[:1] != [
                f"b{target}"
            ]:
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError("swap never reached the new backend")
            swaps.append((time.perf_counter() - t0) * 1000)
        out["upsert_to_traffic_p50_ms"] = round(statistics.median(swaps), 1)
        out["upsert_to_traffic_max_ms"] = round(max(swaps), 1)

        dp = cluster.datapath(node)

        def service_entries() -> int:
            st = dp.ListMaps(datapath_pb2.ListMapsRequest(), timeout=30)
            return next(m.entries for m in st.maps if m.name == "services")

        base = service_entries()
        pids = {
            "lb": cluster.services["lb"].pid,
            # policy follows lb's services too (toServices).
            "policy": cluster.services["policy"].pid,
            "etcd": cluster.etcd.proc.pid if cluster.etcd.proc else 0,
            "datapath": node.process.pid if node.process else 0,
        }

        def bulk(i: int) -> pb.Service:
            return dp_service(f"bulk/s{i}", f"10.98.{i // 250}.{i % 250 + 1}", [backends[i % 2].ip])

        # Built before the clock starts: the figure is from the lb's input on.
        requests = [
            pb.UpsertServicesRequest(services=[bulk(i) for i in range(s, min(s + BATCH, n))])
            for s in range(0, n, BATCH)
        ]

        async def upsert_all() -> None:
            # As a bulk import or a Kubernetes resync would: UpsertServices,
            # BATCH services per call, two calls in flight.
            async with cluster.services["lb"].aio_channel() as ch:
                stub = lb_pb2_grpc.LoadBalancerServiceStub(ch)
                sem = asyncio.Semaphore(2)

                async def one(request: pb.UpsertServicesRequest) -> None:
                    async with sem:
                        await stub.UpsertServices(request, timeout=120)

                await asyncio.gather(*(one(r) for r in requests))

        cpu0 = {who: cpu_seconds(p) for who, p in pids.items() if p}
        spies = start_py_spy(pids)
        t0 = time.perf_counter()
        asyncio.run(upsert_all())
        acked = time.perf_counter() - t0
        # Each service is one frontend entry plus one backend slot. Counting
        # walks the maps on the datapath's map thread, so not too often.
        while service_entries() < base + 2 * n:
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("services never all programmed")
            time.sleep(0.25)
        t_done = time.perf_counter() - t0
        stop_py_spy(spies)
        for who, c0 in cpu0.items():
            out[f"datapath_services_cpu_{who}_ms_per_service"] = round(
                (cpu_seconds(pids[who]) - c0) * 1e3 / n, 3
            )
        out["datapath_services"] = n
        out["datapath_services_acked_s"] = round(acked, 2)
        out["datapath_services_programmed_s"] = round(t_done, 2)
        out["datapath_services_per_s"] = round(n / t_done, 1)
        answer = client.ns.request("tcp", f"10.98.{(n - 1) // 250}.{(n - 1) % 250 + 1}", 80)
        out["datapath_last_service_answers"] = bool(answer)
    return out


def run_service_part(tmp: Path, n: int, quick: bool, results: dict[str, Any]) -> None:
    etcd = EtcdServer(tmp / "etcd").start()
    proc = ServiceProcess(
        "lb",
        [
            "--etcd-endpoints",
            etcd.endpoint,
            "--log-level",
            os.environ.get("BENCH_LB_LOG_LEVEL", "warning"),
        ],
        log_dir=tmp,
    )
    try:
        proc.start().wait_serving()
        results.update(asyncio.run(bench_service(proc, proc.pid, n, 20 if quick else 100)))
    finally:
        proc.stop()
        etcd.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs, within 30 s")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--services", type=int, default=0, help="bulk size (default 10,000)")
    ap.add_argument("--no-datapath", action="store_true", help="skip the datapath part (root)")
    ap.add_argument(
        "--datapath-only", action="store_true", help="only the datapath part (root; no Maglev)"
    )
    args = ap.parse_args()
    n = args.services or (2000 if args.quick else 10000)

    results: dict[str, Any] = {"quick": args.quick}
    if not args.datapath_only:
        results.update(bench_maglev(args.quick))
    with tempfile.TemporaryDirectory(prefix="flagella-bench-lb-") as tmp:
        if not args.datapath_only:
            run_service_part(Path(tmp), n, args.quick, results)
        if os.geteuid() == 0 and not args.no_datapath:
            results.update(bench_datapath(Path(tmp), args.quick, 1000 if args.quick else n))

    if args.json:
        print(json.dumps(results))
        return 0
    rows: list[tuple[str, str]] = []
    if "maglev_m16381_b10_build_ms" in results:
        print("Maglev table build (pure Python, median of runs)")
        print(f"{'M':>7} {'backends':>9} {'weights':>8} {'median ms':>10} {'min ms':>8}")
        for key, value in results.items():
            if key.startswith("maglev_") and key.endswith("_build_ms"):
                parts = key.split("_")
                m, b = parts[1][1:], parts[2][1:]
                weighted = "mixed" if "weighted" in key else "equal"
                mn = results[key.replace("_build_ms", "_build_min_ms")]
                print(f"{m:>7} {b:>9} {weighted:>8} {value:>10} {mn:>8}")
        print()
    if "upsert_ack_p50_ms" in results:
        print("lb service (real etcd, real lb process, gRPC)")
        rows += [
            ("one upsert acknowledged, p50", f"{results['upsert_ack_p50_ms']} ms"),
            ("one upsert to its watch event, p50", f"{results['upsert_to_watch_event_p50_ms']} ms"),
            ("one upsert to its watch event, max", f"{results['upsert_to_watch_event_max_ms']} ms"),
            (f"{n} services: all acknowledged", f"{results['bulk_all_acked_s']} s"),
            (f"{n} services: all on the watch stream", f"{results['bulk_all_on_watch_s']} s"),
            ("  throughput", f"{results['bulk_upserts_per_s']} services/s"),
            ("  upsert to watch event, p50", f"{results['bulk_upsert_to_watch_p50_ms']} ms"),
            ("  upsert to watch event, p99", f"{results['bulk_upsert_to_watch_p99_ms']} ms"),
            ("  lb process CPU per service", f"{results['bulk_lb_cpu_per_service_ms']} ms"),
            (
                f"{n} services by UpsertServices ({BATCH} per call): all on the stream",
                f"{results['batch_all_on_watch_s']} s",
            ),
            ("  throughput", f"{results['batch_upserts_per_s']} services/s"),
            ("  lb process CPU per service", f"{results['batch_lb_cpu_per_service_ms']} ms"),
            (
                f"snapshot of {results['snapshot_services']} on a new stream",
                f"{results['snapshot_stream_s']} s",
            ),
        ]
    if "upsert_to_traffic_p50_ms" in results:
        rows += [
            (
                "upsert to traffic on the new backend, p50",
                f"{results['upsert_to_traffic_p50_ms']} ms",
            ),
            (
                "upsert to traffic on the new backend, max",
                f"{results['upsert_to_traffic_max_ms']} ms",
            ),
            (
                f"{results['datapath_services']} services acked by lb",
                f"{results['datapath_services_acked_s']} s",
            ),
            (
                f"{results['datapath_services']} services programmed in BPF",
                f"{results['datapath_services_programmed_s']} s",
            ),
            ("  rate", f"{results['datapath_services_per_s']} services/s"),
        ]
        for proc in ("lb", "etcd", "datapath"):
            key = f"datapath_services_cpu_{proc}_ms_per_service"
            if key in results:
                rows.append((f"  {proc} CPU per service", f"{results[key]} ms"))
    for label, value in rows:
        print(f"{label:<44} {value:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
