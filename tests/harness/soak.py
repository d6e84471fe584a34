"""A churn soak: pods added and deleted through the real CNI plugin, policy
and service updates, traffic probes between live pods and through a
ClusterIP, and a kill -9 of a random service every few seconds (restarted
at once, as a supervisor would). At the end every pod is deleted and
nothing flagella held for them may remain.

The runtime's part is played as containerd plays it: an ADD that fails with
"try again later" (CNI code 11) is retried after a DEL of the same
attachment; a DEL is retried until it succeeds.

Used by bench/soak.py (minutes, figures) and tests/e2e/test_soak.py (one
minute, every figure asserted)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.common.backoff import Backoff
from harness.cluster import Cluster, Node
from harness.cni import cni, netconf
from harness.leaks import held, holds_only
from harness.netns import Netns, wait_until

NAMESPACE = "soak"
PORT = 8080
VIP = "10.96.77.1"
VICTIMS = ("ipam", "policy", "lb", "endpoint", "datapath")
# Service flags for a soak: identities no pod references are freed within
# seconds (two GC rounds), so that the end state can be compared with the
# start; the tables served to watches keep 1,024 changes, not 16,384, so that
# their logs are full within the warm-up (at the default a 10-minute churn is
# still filling them: ~1.2 MiB a table, docs/ARCHITECTURE.md), as the
# datapath's histories below.
WATCH_HISTORY = ("--watch-history", "1024")
SOAK_EXTRA = {
    "policy": ["--identity-gc-interval", "2", *WATCH_HISTORY],
    "ipam": [*WATCH_HISTORY],
    "lb": [*WATCH_HISTORY],
}
# The datapath's bounded histories (flows for `flagella observe`, writes per
# map for `flagella map events`) made small, so they are full within the
# warm-up: at their defaults they take more than ten minutes of this churn to
# fill (a few MiB at most, docs/BENCHMARKS.md), which a growth figure would
# count as a leak.
SOAK_DATAPATH = ("--flow-buffer-capacity", "256", "--map-event-history", "32")
# etcd compacting its history every minute (deployments keep an hour: see
# docs/RELIABILITY.md), so a long soak measures etcd's memory with its
# history bounded, and the services' watches resume across compactions.
SOAK_ETCD = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1m")
# After a restarted service answers again: its streams resync and the
# datapath catches up. Probe failures up to this long after it count as
# inside the kill window.
SETTLE_S = 3.0
# Keys that outlive the pods by design: the endpoint id counter, and the
# node's identity-reference record (bound to an etcd lease, it lives as long
# as the node does).
KEPT_KEYS = ("flagella/endpoint/v1/next-id", "flagella/state/identities/v1/nodes/")
# An operation retried for longer than this failed for good.
RETRY_BUDGET_S = 60.0
ALLOW = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: soak-allow, namespace: soak}}
spec:
  endpointSelector: {{matchLabels: {{role: soak}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{role: soak}}}}]
    toPorts: [{{ports: [{{port: "{port}", protocol: TCP}}]}}]
"""
# Updated back and forth during the soak; it never touches PORT.
EXTRA = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: soak-extra, namespace: soak}}
spec:
  endpointSelector: {{matchLabels: {{role: soak}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{app: {app}}}}}]
    toPorts: [{{ports: [{{port: "{port}", protocol: TCP}}]}}]
"""


@dataclass
class SoakPod:
    name: str
    container_id: str
    ns: Netns
    ip: str
    app: str


@dataclass
class Window:
    victim: str
    start: float
    end: float = float("inf")


@dataclass
class Probe:
    kind: str  # "pod" or "service"
    src: str
    dst: str
    start: float
    end: float
    ok: bool


@dataclass
class Sample:
    at: float
    process: str
    pid: int
    rss_kb: int
    fds: int


@dataclass
class SoakResult:
    seconds: float
    adds: int = 0
    add_retries: int = 0
    add_failures: list[str] = field(default_factory=list)
    dels: int = 0
    del_retries: int = 0
    del_failures: list[str] = field(default_factory=list)
    policy_updates: int = 0
    service_updates: int = 0
    update_retries: int = 0
    windows: list[Window] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    leaks: dict[str, Any] = field(default_factory=dict)
    etcd_keys_left: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def in_window(self, probe: Probe) -> bool:
        return any(probe.start < w.end + SETTLE_S and probe.end > w.start for w in self.windows)

    def probe_failures_outside_windows(self) -> list[Probe]:
        return [p for p in self.probes if not p.ok and not self.in_window(p)]

    def growth_per_minute(self, warm_up: float) -> dict[str, tuple[float, float]]:
        """Per process: the largest (RSS KiB, open files) growth per minute
        (least squares) over any one process lifetime, leaving out its first
        warm_up seconds (a process fills its caches first); lifetimes with
        less than 20 s of samples left count not."""
        runs: dict[tuple[str, int], list[Sample]] = {}
        for s in self.samples:
            runs.setdefault((s.process, s.pid), []).append(s)
        out: dict[str, tuple[float, float]] = {}
        for (process, _), lifetime in runs.items():
            run = [s for s in lifetime if s.at - lifetime[0].at >= warm_up]
            if len(run) < 3 or run[-1].at - run[0].at < 20:
                continue
            ts = [s.at for s in run]
            rss = _slope(ts, [float(s.rss_kb) for s in run]) * 60
            fds = _slope(ts, [float(s.fds) for s in run]) * 60
            old = out.get(process, (float("-inf"), float("-inf")))
            out[process] = (max(old[0], rss), max(old[1], fds))
        return out

    def figures(self, warm_up: float) -> dict[str, float]:
        failed = [p for p in self.probes if not p.ok]
        growth = self.growth_per_minute(warm_up)
        figures: dict[str, float] = {
            "minutes": self.seconds / 60,
            "adds": self.adds,
            "add_retries": self.add_retries,
            "add_failures": len(self.add_failures),
            "dels": self.dels,
            "del_failures": len(self.del_failures),
            "policy_updates": self.policy_updates,
            "service_updates": self.service_updates,
            "kills": len(self.windows),
            "probes": len(self.probes),
            "probe_failure_share_pct": 100 * len(failed) / max(1, len(self.probes)),
            "probe_failures_outside_kill_windows": len(self.probe_failures_outside_windows()),
            "leaked_items": sum(len(v) if isinstance(v, list) else v for v in self.leaks.values()),
            "leaked_etcd_keys": len(self.etcd_keys_left),
        }
        for process, (rss, fds) in sorted(growth.items()):
            figures[f"rss_growth_kib_per_min_{process}"] = rss
            figures[f"fd_growth_per_min_{process}"] = fds
        return figures


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _process_figures(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


class Soak:
    """One soak on a started cluster (ipam, policy, lb, endpoint) with one
    node. Run it with run(seconds)."""

    def __init__(
        self,
        cluster: Cluster,
        node: Node,
        *,
        pods: int = 6,
        kill_interval: float = 5.0,
        victims: tuple[str, ...] = VICTIMS,
        seed: int | None = None,
        log: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.cluster = cluster
        self.node = node
        self.target = pods
        self.kill_interval = kill_interval
        self.victims = victims
        self.rng = random.Random(seed)
        self.log = log
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.live: dict[str, SoakPod] = {}
        self.busy: dict[str, int] = {}
        self.anchors: list[SoakPod] = []
        self.counter = 0
        self.result = SoakResult(0.0)
        self.conf = netconf(node.cni_socket, timeout=30)
        self.policy = cluster.policy()
        self.lb = cluster.lb()

    # --- pods ---

    def _new_pod(self, app: str) -> SoakPod | None:
        with self.lock:
            self.counter += 1
            name = f"s{self.counter}"
        ns = self.cluster.pod(self.node, name)
        pod = SoakPod(name, f"ctr-{name}", ns, "", app)
        conf = dict(self.conf, args={"cni": {"labels": {"app": app, "role": "soak"}}})
        deadline = time.monotonic() + RETRY_BUDGET_S
        backoff = Backoff(0.2, 2.0)
        while True:
            rc, out = cni("ADD", conf, container_id=pod.container_id, netns=ns.path,
                          pod=(NAMESPACE, name), timeout=60)  # fmt: skip
            if rc == 0:
                pod.ip = str(out["ips"][0]["address"]).split("/")[0]
                ns.serve("tcp", PORT, name)
                with self.lock:
                    self.result.adds += 1
                return pod
            transient = out.get("code") == 11
            if not transient or time.monotonic() > deadline or self.stop.is_set():
                with self.lock:
                    self.result.add_failures.append(f"{name}: {out}")
                self._delete(pod)
                return None
            with self.lock:
                self.result.add_retries += 1
            # As containerd does: the sandbox is torn down, then set up again.
            self._del_attachment(pod)
            self.stop.wait(backoff.next())

    def _del_attachment(self, pod: SoakPod) -> bool:
        deadline = time.monotonic() + RETRY_BUDGET_S
        backoff = Backoff(0.2, 2.0)
        while True:
            rc, out = cni("DEL", self.conf, container_id=pod.container_id, netns=pod.ns.path,
                          timeout=60)  # fmt: skip
            if rc == 0:
                return True
            if time.monotonic() > deadline:
                with self.lock:
                    self.result.del_failures.append(f"{pod.name}: {out}")
                return False
            with self.lock:
                self.result.del_retries += 1
            time.sleep(backoff.next())

    def _delete(self, pod: SoakPod) -> None:
        if self._del_attachment(pod):
            with self.lock:
                self.result.dels += 1
        pod.ns.cleanup()

    @contextlib.contextmanager
    def _using(self, *pods: SoakPod) -> Iterator[None]:
        with self.lock:
            for p in pods:
                self.busy[p.name] = self.busy.get(p.name, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                for p in pods:
                    self.busy[p.name] -= 1

    def _churn(self) -> None:
        while not self.stop.is_set():
            victim: SoakPod | None = None
            with self.lock:
                if len(self.live) >= self.target:
                    idle = [p for p in self.live.values() if not self.busy.get(p.name)]
                    if idle:
                        victim = self.live.pop(self.rng.choice(idle).name)
            if victim is not None:
                self._delete(victim)
            pod = self._new_pod(f"churn{self.counter % 3}")
            if pod is not None:
                with self.lock:
                    self.live[pod.name] = pod

    # --- traffic ---

    def _probes(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                pods = list(self.live.values()) + self.anchors
            if len(pods) < 2:
                self.stop.wait(0.1)
                continue
            src, dst = self.rng.sample(pods, 2)
            # Through the ClusterIP (an anchor may reach itself: hairpin).
            via_service = self.rng.random() < 0.3
            kind, host = ("service", VIP) if via_service else ("pod", dst.ip)
            with self._using(src, dst):
                start = time.monotonic()
                answer = src.ns.request("tcp", host, PORT if kind == "pod" else 80, timeout=1.0)
                end = time.monotonic()
            with self.lock:
                self.result.probes.append(
                    Probe(
                        kind,
                        src.name,
                        dst.name if kind == "pod" else VIP,
                        start,
                        end,
                        answer is not None,
                    )
                )

    # --- control-plane updates ---

    def _call(self, fn: Callable[[], Any]) -> None:
        """An API call retried through the kills (UNAVAILABLE and timeouts
        are a killed service; anything else is a failure)."""
        backoff = Backoff(0.2, 2.0)
        deadline = time.monotonic() + RETRY_BUDGET_S
        while True:
            try:
                fn()
                return
            except grpc.RpcError as exc:
                transient = exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                if not transient or time.monotonic() > deadline:
                    raise
            with self.lock:
                self.result.update_retries += 1
            time.sleep(backoff.next())

    def _service(self, backends: list[SoakPod]) -> lb_pb2.Service:
        svc = lb_pb2.Service(
            name=f"{NAMESPACE}/web",
            namespace=NAMESPACE,
            frontend=lb_pb2.Frontend(address=VIP, port=80, protocol=lb_pb2.PROTOCOL_TCP),
        )
        for b in backends:
            svc.backends.append(lb_pb2.Backend(address=b.ip, port=PORT))
        return svc

    def _updates(self) -> None:
        flip = 0
        while not self.stop.wait(1.0):
            flip += 1
            try:
                if flip % 2:
                    doc = EXTRA.format(app=f"churn{flip % 3}", port=9000 + flip % 7)
                    self._call(
                        lambda d=doc: self.policy.PutRules(  # type: ignore[misc]
                            policy_pb2.PutRulesRequest(document=d), timeout=5
                        )
                    )
                    self.result.policy_updates += 1
                else:
                    # The anchors never go: any subset of them is a valid
                    # backend set, so the VIP probes stay meaningful.
                    backends = self.anchors[: 1 + flip // 2 % len(self.anchors)]
                    svc = self._service(backends)
                    self._call(lambda s=svc: self.lb.UpsertService(  # type: ignore[misc]
                        lb_pb2.UpsertServiceRequest(service=s), timeout=5))  # fmt: skip
                    self.result.service_updates += 1
            except grpc.RpcError as exc:
                self.result.errors.append(f"update: {exc.code().name} {exc.details()}")

    # --- faults ---

    def _kills(self) -> None:
        if self.kill_interval <= 0:
            return
        deck: list[str] = []
        while not self.stop.wait(self.kill_interval * (0.5 + self.rng.random())):
            # Every victim once per round, in a random order.
            if not deck:
                deck = self.rng.sample(self.victims, len(self.victims))
            victim = deck.pop()
            window = Window(victim, time.monotonic())
            self.result.windows.append(window)
            self.log(f"kill -9 {victim}")
            try:
                if victim == "datapath":
                    assert self.node.process is not None
                    self.node.process.kill9()
                    self.cluster.start_datapath(self.node)
                else:
                    self.cluster.restart(victim, kill=True)
            except Exception as exc:
                self.result.errors.append(f"restart {victim}: {exc!r}")
            window.end = time.monotonic()

    def _processes(self) -> dict[str, int]:
        procs = {svc: p.pid for svc, p in self.cluster.services.items() if p.proc is not None}
        if self.node.process is not None and self.node.process.proc is not None:
            procs["datapath"] = self.node.process.pid
        if self.cluster.etcd.proc is not None:
            procs["etcd"] = self.cluster.etcd.proc.pid
        return procs

    def _sampler(self) -> None:
        while not self.stop.wait(1.0):
            now = time.monotonic()
            for process, pid in self._processes().items():
                got = _process_figures(pid)
                if got is not None:
                    self.result.samples.append(Sample(now, process, pid, *got))

    # --- the run ---

    def run(self, seconds: float) -> SoakResult:
        cluster = self.cluster
        baseline = set(_etcd_keys(cluster))
        self._call(lambda: self.policy.PutRules(
            policy_pb2.PutRulesRequest(document=ALLOW.format(port=PORT)), timeout=10))  # fmt: skip
        for i in range(2):
            anchor = self._new_pod(f"anchor{i}")
            assert anchor is not None, self.result.add_failures
            self.anchors.append(anchor)
        self._call(lambda: self.lb.UpsertService(
            lb_pb2.UpsertServiceRequest(service=self._service(self.anchors)), timeout=10))  # fmt: skip
        threads = [
            threading.Thread(target=fn, name=fn.__name__, daemon=True)
            for fn in (self._churn, self._probes, self._updates, self._kills, self._sampler)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        self.stop.wait(seconds)
        self.stop.set()
        for t in threads:
            t.join(120)
        self.result.seconds = time.monotonic() - started
        self._end(baseline)
        return self.result

    def _end(self, baseline: set[str]) -> None:
        cluster, node = self.cluster, self.node
        for proc in cluster.services.values():
            proc.wait_serving(60)
        assert node.process is not None
        node.process.wait_serving(60)
        for pod in [*self.live.values(), *self.anchors]:
            self._delete(pod)
        self.live.clear()
        self._call(lambda: self.lb.DeleteService(
            lb_pb2.DeleteServiceRequest(name=f"{NAMESPACE}/web"), timeout=10))  # fmt: skip
        for name in ("soak-allow", "soak-extra"):
            with contextlib.suppress(grpc.RpcError):
                self.policy.DeleteRule(
                    policy_pb2.DeleteRuleRequest(name=f"{NAMESPACE}/{name}"), timeout=10
                )
        empty: dict[str, str] = {}
        if not wait_until(lambda: holds_only(held(cluster, node), empty, {}), timeout=30):
            got = held(cluster, node)
            self.result.leaks = {k: v for k, v in got.items() if v}
        keys_left: list[str] = []

        def etcd_clean() -> bool:
            keys_left[:] = sorted(
                k for k in set(_etcd_keys(cluster)) - baseline if not k.startswith(KEPT_KEYS)
            )
            return not keys_left

        wait_until(etcd_clean, timeout=30, interval=0.5)
        self.result.etcd_keys_left = keys_left


def _etcd_keys(cluster: Cluster) -> list[str]:
    async def keys() -> list[str]:
        etcd = cluster.etcd.client()
        try:
            kvs, _ = await etcd.get_prefix("flagella/")
            return [kv.key if isinstance(kv.key, str) else kv.key.decode() for kv in kvs]
        finally:
            await etcd.close()

    return asyncio.run(keys())
