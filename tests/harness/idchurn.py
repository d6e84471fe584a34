"""Identity churn against a real policy process and etcd: hold many
identities, then create and delete pods with unique labels at a steady rate
(each pod a new identity, each deleted one garbage), sampling the identities
in use and the garbage every second. The engine of bench/identity_churn.py
and of its CI test.

A pod's identity is taken as the endpoint service takes it on a CNI ADD
(AllocateIdentity with labels, node and owner `<container id>/eth0`, as the
endpoint service's identity) and given back as on a DEL (ReleaseIdentity of
that owner): the path a pod's ADD uses, without the rest of the ADD.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg
from flagella.common import pki
from flagella.policy.keys import ID_PREFIX, IDENT_PREFIX, VALUE_PREFIX
from harness.etcd import EtcdServer
from harness.metrics import histogram_quantile, value
from harness.procs import ServiceProcess
from harness.svcbench import cpu_seconds

#: Seconds between the signs of life of every node (its lease TTL: 900 s).
KEEPALIVE_S = 120.0
SLOW_MS = 50.0  # the allocation p99 target
#: Endpoints per node (the dense node's count): held identities are spread so.
PODS_PER_NODE = 250


def pod_labels(kind: str, i: int) -> list[pb.Label]:
    """A pod's labels, unique to it (its identity is its own)."""
    return [
        pb.Label(source="k8s", key="io.kubernetes.pod.namespace", value="churn"),
        pb.Label(source="k8s", key="app", value=f"{kind}-{i}"),
        pb.Label(source="k8s", key="pod-template-hash", value="5d8f7c9b4"),
    ]


def owner(kind: str, i: int) -> str:
    return f"{kind[0]}{i:063x}/eth0"


@dataclass(frozen=True)
class Sample:
    t: float
    global_identities: int  # the service's count (flagella_identity{type="global"})
    unreferenced: int  # allocated, no reference: garbage the GC has yet to free
    in_use: int  # held + pods alive, as this engine counts them
    gc_runs: int
    gc_last_s: float


@dataclass
class ChurnResult:
    held: int = 0
    hold_s: float = 0.0
    created: int = 0
    deleted: int = 0
    alloc_ms: list[float] = field(default_factory=list)
    release_ms: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # in-use identities gone or remapped
    etcd_keys: dict[str, int] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    rss_kib: dict[str, int] = field(default_factory=dict)
    drained_s: float | None = None
    # The churn's allocations (start on the churn's clock, ms), to tell
    # whether the slow ones wait on a GC round.
    alloc_at: list[tuple[float, float]] = field(default_factory=list)
    # Quantiles of what etcd and the policy's etcd client saw in the churn.
    etcd_ms: dict[str, float] = field(default_factory=dict)
    churn_s: float = 0.0  # from the first pod to the last one's release

    def figures(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            return (
                round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 2)
                if len(xs) > 1
                else 0.0
            )

        churn = self.samples
        gc = sorted({(s.gc_runs, s.gc_last_s) for s in churn if s.gc_runs})
        out: dict[str, Any] = {
            "held_identities_count": self.held,
            "hold_s": round(self.hold_s, 1),
            "pods_created_count": self.created,
            "pods_deleted_count": self.deleted,
            "achieved_pods_per_s": round(self.created / self.churn_s, 1) if self.churn_s else 0.0,
            "allocate_p50_ms": pct(self.alloc_ms, 50),
            "allocate_p99_ms": pct(self.alloc_ms, 99),
            "allocate_max_ms": round(max(self.alloc_ms, default=0.0), 2),
            "release_p50_ms": pct(self.release_ms, 50),
            "release_p99_ms": pct(self.release_ms, 99),
            "garbage_max_count": max((s.unreferenced for s in churn), default=0),
            "garbage_last_count": churn[-1].unreferenced if churn else 0,
            "in_use_max_count": max((s.in_use for s in churn), default=0),
            "identities_max_count": max((s.global_identities for s in churn), default=0),
            "gc_runs_count": max((s.gc_runs for s in churn), default=0),
            "gc_pass_max_ms": round(max((g[1] for g in gc), default=0.0) * 1e3, 1),
            "gc_pass_median_ms": round(statistics.median(g[1] for g in gc) * 1e3, 1) if gc else 0.0,
            "errors_count": len(self.errors),
            "in_use_lost_count": len(self.lost),
            "drained_s": None if self.drained_s is None else round(self.drained_s, 1),
        }
        for name, count in self.etcd_keys.items():
            out[f"etcd_identity_keys_{name}_count"] = count
        if self.created:  # CPU of the churn phase
            for process in ("policy", "etcd"):
                cpu = self.cpu_s.get(process, 0.0)
                out[f"{process}_cpu_churn_s"] = round(cpu, 2)
                out[f"{process}_cpu_per_pod_ms"] = round(cpu / self.created * 1e3, 2)
        for name, rss in self.rss_kib.items():
            out[f"policy_rss_{name}_mib"] = round(rss / 1024, 1)
        out.update(self.etcd_ms)
        slow = [at for at, ms in self.alloc_at if ms > SLOW_MS]
        # A round ended within the second before the sample that counted it
        # first (the sampler's clock starts with the churn's): its window is
        # its duration before that, plus the second.
        rounds = [(s.t, s.gc_last_s) for p, s in itertools.pairwise(churn) if s.gc_runs > p.gc_runs]
        in_gc = [at for at in slow if any(end - took - 1.0 <= at <= end for end, took in rounds)]
        out["allocations_over_50ms_count"] = len(slow)
        out["allocations_over_50ms_during_gc_count"] = len(in_gc)
        return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class IdentityChurn:
    """One churn run against a started policy process (and its etcd)."""

    def __init__(self, proc: ServiceProcess, etcd: EtcdServer, *, concurrency: int = 32) -> None:
        self.proc = proc
        self.etcd = etcd
        self.concurrency = concurrency
        self.result = ChurnResult()
        # label key (kind, i) -> identity, for everything this engine holds.
        self.in_use: dict[tuple[str, int], int] = {}
        self._churn_t0: float | None = None  # the churn's clock (monotonic)

    def _node(self, i: int) -> str:
        return f"churn-node-{i // PODS_PER_NODE}"

    async def run(self, held: int, rate: float, seconds: float, lifetime: float) -> ChurnResult:
        channel = self.proc.aio_channel(pki.service("endpoint"))
        self.stub = pbg.PolicyServiceStub(channel)
        self.etcd_client = self.etcd.client()
        keepalive: asyncio.Task[None] | None = None
        try:
            self.result.etcd_keys["start"] = await self._identity_keys()
            nodes = (held + PODS_PER_NODE - 1) // PODS_PER_NODE
            keepalive = asyncio.create_task(self._keep_nodes_alive(nodes))
            t0 = time.perf_counter()
            await self._hold(held)
            self.result.hold_s = time.perf_counter() - t0
            self.result.held = held
            self.result.etcd_keys["held"] = await self._identity_keys()
            assert self.etcd.proc is not None
            etcd_pid = self.etcd.proc.pid
            cpu0, etcd_cpu0 = cpu_seconds(self.proc.pid), cpu_seconds(etcd_pid)
            scrapes0 = await asyncio.to_thread(self._scrapes)
            self.result.rss_kib["after_hold"] = rss_kib(self.proc.pid)
            await self._churn(rate, seconds, lifetime)
            self.result.cpu_s["policy"] = cpu_seconds(self.proc.pid) - cpu0
            self.result.cpu_s["etcd"] = cpu_seconds(etcd_pid) - etcd_cpu0
            self._etcd_quantiles(scrapes0, await asyncio.to_thread(self._scrapes))
            self.result.rss_kib["after_churn"] = rss_kib(self.proc.pid)
            self.result.lost = await self._check_in_use()
            self.result.etcd_keys["end_of_churn"] = await self._identity_keys()
        finally:
            if keepalive is not None:
                keepalive.cancel()
            await channel.close()
        return self.result

    def _scrapes(self) -> tuple[str, str]:
        """The policy's and etcd's metrics now."""
        with urllib.request.urlopen(self.etcd.metrics_url, timeout=10) as got:
            etcd = got.read().decode()
        return self.proc.scrape(), etcd

    def _etcd_quantiles(self, before: tuple[str, str], after: tuple[str, str]) -> None:
        """p99 of the policy's etcd calls (by RPC) and of etcd's own disk
        writes over the churn: is a slow allocation etcd's time or ours?"""
        figures = self.result.etcd_ms
        for action in ("Txn", "Range"):
            figures[f"policy_etcd_{action.lower()}_p99_ms"] = 1e3 * histogram_quantile(
                before[0],
                after[0],
                "flagella_kvstore_operations_duration_seconds",
                0.99,
                action=action,
            )
        # The policy process's own stalls: its full garbage collections.
        gc_name, full = "flagella_python_gc_pause_seconds", {"generation": "2"}

        def delta(sample: str, **labels: str) -> float:
            return value(after[0], sample, **labels) - value(before[0], sample, **labels)

        figures["policy_full_gc_count"] = delta(f"{gc_name}_count", **full)
        figures["policy_full_gc_over_50ms_count"] = delta(f"{gc_name}_count", **full) - delta(
            f"{gc_name}_bucket", le="0.05", **full
        )
        figures["policy_full_gc_total_ms"] = round(1e3 * delta(f"{gc_name}_sum", **full), 1)
        figures["policy_gc_pause_p99_ms"] = 1e3 * histogram_quantile(
            before[0], after[0], gc_name, 0.99
        )
        # etcd's database at the end, and where a slow commit of its
        # backend went (bbolt's rebalance, spill and write phases).
        figures["etcd_db_mib"] = round(
            value(after[1], "etcd_mvcc_db_total_size_in_bytes") / 2**20, 1
        )
        for name, metric in (
            ("wal_fsync", "etcd_disk_wal_fsync_duration_seconds"),
            ("backend_commit", "etcd_disk_backend_commit_duration_seconds"),
            ("commit_rebalance", "etcd_debugging_disk_backend_commit_rebalance_duration_seconds"),
            ("commit_spill", "etcd_debugging_disk_backend_commit_spill_duration_seconds"),
            ("commit_write", "etcd_debugging_disk_backend_commit_write_duration_seconds"),
            ("apply", "etcd_server_apply_duration_seconds"),
        ):
            figures[f"etcd_{name}_p99_ms"] = 1e3 * histogram_quantile(
                before[1], after[1], metric, 0.99
            )

    async def drain(self, timeout: float) -> None:
        """Waits until the GC has freed every churned identity (the held ones
        left, nothing leaked), recording how long it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            ids, _ = await self.etcd_client.count_prefix(ID_PREFIX)
            if ids == self.result.held:
                self.result.drained_s = time.monotonic() - t0
                break
            await asyncio.sleep(0.2)
        self.result.etcd_keys["drained"] = await self._identity_keys()
        await self.etcd_client.close()

    async def _identity_keys(self) -> int:
        count, _ = await self.etcd_client.count_prefix(IDENT_PREFIX)
        return count

    async def _allocate(self, kind: str, i: int) -> int | None:
        t0, started = time.perf_counter(), time.monotonic()
        try:
            resp = await self.stub.AllocateIdentity(
                pb.AllocateIdentityRequest(
                    labels=pod_labels(kind, i), node=self._node(i), owner=owner(kind, i)
                ),
                timeout=30,
            )
        except grpc.aio.AioRpcError as exc:  # counted and reported
            self.result.errors.append(f"allocate {kind}-{i}: {exc!r}"[:300])
            return None
        if kind == "pod":
            took_ms = (time.perf_counter() - t0) * 1e3
            self.result.alloc_ms.append(took_ms)
            if self._churn_t0 is not None:
                self.result.alloc_at.append((started - self._churn_t0, took_ms))
        ident = int(resp.identity.id)
        self.in_use[(kind, i)] = ident
        return ident

    async def _release(self, kind: str, i: int) -> None:
        ident = self.in_use.pop((kind, i))
        t0 = time.perf_counter()
        try:
            await self.stub.ReleaseIdentity(
                pb.ReleaseIdentityRequest(id=ident, node=self._node(i), owner=owner(kind, i)),
                timeout=30,
            )
        except grpc.aio.AioRpcError as exc:
            self.result.errors.append(f"release {kind}-{i}: {exc!r}"[:300])
            return
        self.result.release_ms.append((time.perf_counter() - t0) * 1e3)
        self.result.deleted += 1

    async def _hold(self, count: int) -> None:
        queue = iter(range(count))

        async def worker() -> None:
            for i in queue:
                await self._allocate("held", i)

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    async def _keep_nodes_alive(self, nodes: int) -> None:
        """A sign of life of every node every KEEPALIVE_S, as a datapath's
        WatchPolicy stream gives (an owner's repeat: nothing written), so
        the held references outlive --node-lease-ttl (900 s) however long
        the run: a node that shows none loses its references."""
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            for node in range(nodes):
                i = node * PODS_PER_NODE
                if ("held", i) in self.in_use:
                    await self._allocate("held", i)

    async def _pod(self, i: int, lifetime: float) -> None:
        if await self._allocate("pod", i) is None:
            return
        self.result.created += 1
        await asyncio.sleep(lifetime)
        await self._release("pod", i)

    async def _churn(self, rate: float, seconds: float, lifetime: float) -> None:
        """A new pod every 1/rate s for seconds, each deleted lifetime s after
        its identity came back; then waits for the last ones."""
        sampler = asyncio.create_task(self._sample())
        pods: set[asyncio.Task[None]] = set()
        start = self._churn_t0 = time.monotonic()
        i = 0
        try:
            while (now := time.monotonic()) - start < seconds:
                due = int((now - start) * rate) + 1
                while i < due:
                    task = asyncio.create_task(self._pod(i, lifetime))
                    pods.add(task)
                    task.add_done_callback(pods.discard)
                    i += 1
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            if pods:
                await asyncio.gather(*pods)
            self.result.churn_s = time.monotonic() - start
        finally:
            sampler.cancel()

    async def _sample(self) -> None:
        t0 = time.monotonic()
        while True:
            try:
                scrape = await asyncio.to_thread(self.proc.scrape)
            except OSError as exc:
                self.result.errors.append(f"scrape: {exc!r}")
            else:
                self.result.samples.append(
                    Sample(
                        t=time.monotonic() - t0,
                        global_identities=int(value(scrape, "flagella_identity", type="global")),
                        unreferenced=int(value(scrape, "flagella_identity_unreferenced")),
                        in_use=len(self.in_use),
                        gc_runs=int(value(scrape, "flagella_identity_gc_runs_total")),
                        gc_last_s=value(scrape, "flagella_identity_gc_last_duration_seconds"),
                    )
                )
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0) % 1.0))

    async def _check_in_use(self) -> list[str]:
        """Every identity this engine holds still exists in etcd with its
        labels, and still has this engine's reference."""
        ids, _ = await self.etcd_client.get_prefix(ID_PREFIX)
        labels_of = {int(kv.key.rsplit("/", 1)[1]): kv.value.decode() for kv in ids}
        refs, _ = await self.etcd_client.get_prefix(VALUE_PREFIX, keys_only=True)
        owners = {kv.key.rsplit("/", 2)[-2] + "/" + kv.key.rsplit("/", 1)[1] for kv in refs}
        lost = []
        for (kind, i), ident in self.in_use.items():
            stored = labels_of.get(ident)
            if stored is None or f'app={kind}-{i}"' not in stored:
                lost.append(f"{kind}-{i}: identity {ident} is {stored!r}")
            elif f"{self._node(i)}/{owner(kind, i).replace('/', '%2F')}" not in owners:
                lost.append(f"{kind}-{i}: the reference of identity {ident} is gone")
        return lost
