"""Fan-out of the control plane to many nodes: a rule change, a service
change and a new endpoint's ipcache entry, timed from the write until every
node subscriber has it (harness.fanout_node: light processes, each running
many nodes with their own certificates and every stream a datapath opens),
with the CPU and memory of each control-plane process and etcd, at rest and
during the changes, and etcd's requests at rest.

Used by bench/fanout.py (200 and 1,000 nodes, figures) and
tests/integration/test_fanout.py (a few nodes, convergence asserted)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.common import pki
from flagella.common.backoff import Backoff
from harness import tls
from harness.cluster import Cluster
from harness.metrics import samples
from harness.svcbench import cpu_seconds

T = TypeVar("T")

TESTS = Path(__file__).resolve().parents[1]
KINDS = ("rule", "service", "ipcache")
# Every node holds a reference to this identity (as if it ran one such
# pod), so a rule selecting it (cluster-wide) reaches every node's
# WatchPolicy.
LABELS = {"app": "fanout"}
RULE = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: fanout}}
spec:
  endpointSelector: {{matchLabels: {{app: fanout}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{app: fanout}}}}]
    toPorts: [{{ports: [{{port: "{port}", protocol: TCP}}]}}]
"""
SERVICE = "fanout/web"
VIP = "10.96.200.1"
# Flags for a control plane of 1,000+ nodes: /26 pod CIDRs (1,024 nodes in
# the harness's /16).
FANOUT_EXTRA = {"ipam": ["--node-mask-size-v4", "26"]}
# The etcd counters read as requests: RPCs started and stream messages
# received (a lease keep-alive is one message on a long stream).
ETCD_COUNTERS = ("grpc_server_started_total", "grpc_server_msg_received_total")


@dataclass
class Usage:
    """Per process: CPU seconds over a window, and RSS (KiB) at its end."""

    seconds: float
    cpu: dict[str, float]
    rss_kib: dict[str, int]


@dataclass
class Round:
    """The figures at one node count."""

    nodes: int
    # Per kind: every node's latency (s) of every change of that kind.
    latencies: dict[str, list[float]] = field(default_factory=dict)
    changes: int = 0
    rest: Usage | None = None
    # Per kind: over its changes.
    during: dict[str, Usage] = field(default_factory=dict)
    # Per counter: its increase per node per minute at rest.
    etcd_rest: dict[str, float] = field(default_factory=dict)
    load: tuple[str, str] = ("", "")


def retried(call: Callable[[], T], *, attempts: int = 8) -> T:
    """call() again while it fails with UNAVAILABLE (a busy replica's
    answer: "retry"), with jittered backoff, as the services' own clients
    retry; every call retried here is idempotent (a rule document put
    again, a service upserted again, an owner's reference taken again, an
    ipcache entry written again)."""
    backoff = Backoff(0.2, 5.0)
    for attempt in range(attempts):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE or attempt == attempts - 1:
                raise
        time.sleep(backoff.next())
    raise AssertionError("unreachable")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


class WorkerProcess:
    """One harness.fanout_node process and its JSON lines."""

    def __init__(self, config: dict[str, Any], log: Path) -> None:
        self.log = log
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harness.fanout_node"],
                cwd=TESTS,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.send(config)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put({"exited": self.proc.wait()})

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def wait_for(self, key: str, value: Any = None, timeout: float = 60.0) -> dict[str, Any]:
        """The next message holding key (equal to value, if given)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                msg = self.lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise TimeoutError(f"no {key} {value} in {timeout}s: {self.tail()}") from None
            if "exited" in msg:
                raise RuntimeError(f"node worker exited {msg['exited']}: {self.tail()}")
            if key in msg and (value is None or msg[key] == value):
                return msg

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self, timeout: float = 30.0) -> int:
        """End its input (it closes every stream and exits); kill if it
        does not."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


class Fanout:
    """Node subscribers on a started cluster (ipam, policy, lb, endpoint:
    FANOUT_EXTRA), grown with grow(n), measured with measure()."""

    def __init__(
        self,
        cluster: Cluster,
        log_dir: Path,
        *,
        per_worker: int = 125,
        log: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.cluster = cluster
        self.log_dir = log_dir
        self.per_worker = per_worker
        self.log = log
        self.workers: list[WorkerProcess] = []
        self.nodes: list[str] = []
        self.ids = itertools.count(1)
        self.port = 1000
        # The rule's port now (self.port also moves with the service's).
        self.rule_port = self.port
        self.ips = itertools.count(1)
        self.policy = cluster.policy()
        self.lb = cluster.lb()
        as_endpoint = pki.service("endpoint")
        self.endpoint_policy = cluster.policy(as_endpoint)
        self.identity = 0
        self.peers = {svc: cluster.services[svc].address for svc in ("ipam", "policy", "lb")}

    # --- set-up ---

    def _node(self, i: int) -> dict[str, str]:
        name = f"fan{i}"
        bundle = tls.session().bundle(pki.node(name))
        return {"name": name, "ip": f"172.30.{i // 250}.{i % 250 + 1}", "bundle": str(bundle)}

    def grow(self, total: int) -> None:
        """Nodes up to total, registered and synced, each referencing the
        fan-out identity, every one holding the current rule."""
        if not self.nodes:
            self._put_rule()
            self._put_service()
        start = len(self.nodes)
        specs = [self._node(i) for i in range(start, total)]
        # One worker's nodes at a time (and in it, a few at a time): nodes
        # join a cluster over minutes; hundreds registering at the same
        # instant is a restart storm, which this does not measure.
        for k in range(0, len(specs), self.per_worker):
            chunk = specs[k : k + self.per_worker]
            log = self.log_dir / f"fanout-nodes-{len(self.workers)}.log"
            worker = WorkerProcess({**self.peers, "nodes": chunk}, log)
            self.workers.append(worker)
            worker.wait_for("ready", timeout=300)
        self.nodes += [s["name"] for s in specs]
        self.log(f"{total} nodes registered and synced")
        # Each new node references the identity (as the endpoint service
        # does for a pod on it); then every node must hold the rule.
        self._expecting(
            "rule",
            {"port": self.rule_port},
            lambda: self._reference_all(self.nodes[start:]),
            timeout=60 + total / 5,
        )

    def _reference(self, node: str) -> int:
        labels = [policy_pb2.Label(source="k8s", key=k, value=v) for k, v in LABELS.items()]
        resp = retried(
            lambda: self.endpoint_policy.AllocateIdentity(
                policy_pb2.AllocateIdentityRequest(labels=labels, node=node, owner="fanout"),
                timeout=30,
            )
        )
        self.identity = resp.identity.id
        return self.identity

    def _reference_all(self, nodes: list[str]) -> None:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(self._reference, nodes))

    # --- the changes ---

    def _put_rule(self) -> None:
        self.rule_port = self.port
        doc = RULE.format(port=self.port)
        retried(lambda: self.policy.PutRules(policy_pb2.PutRulesRequest(document=doc), timeout=30))

    def _put_service(self) -> None:
        svc = lb_pb2.Service(
            name=SERVICE,
            namespace="fanout",
            frontend=lb_pb2.Frontend(address=VIP, port=80, protocol=lb_pb2.PROTOCOL_TCP),
            backends=[lb_pb2.Backend(address="10.200.0.10", port=self.port)],
        )
        retried(lambda: self.lb.UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=30))

    def _put_ipcache(self, prefix: str) -> None:
        entry = policy_pb2.IPCacheEntry(
            prefix=prefix, identity=self.identity, node=self.nodes[0], source="endpoint"
        )
        retried(
            lambda: self.endpoint_policy.UpsertIPCache(
                policy_pb2.UpsertIPCacheRequest(entry=entry), timeout=30
            )
        )

    def _expecting(
        self, kind: str, what: dict[str, Any], write: Callable[[], None], timeout: float
    ) -> list[float]:
        """Arm every worker, write, and wait until every node saw it: each
        node's delay from the write's start (s)."""
        exp = next(self.ids)
        for w in self.workers:
            w.send({"expect": exp, "kind": kind, **what})
        for w in self.workers:
            w.wait_for("armed", exp)
        t0 = time.time()
        write()
        times: list[float] = []
        for w in self.workers:
            times += w.wait_for("seen", exp, timeout=timeout)["times"]
        return [t - t0 for t in times]

    def change(self, kind: str, timeout: float = 60.0) -> list[float]:
        """One change of kind; every node's delay until it had it (s)."""
        if kind == "ipcache":
            n = next(self.ips)
            prefix = f"10.201.{n // 250}.{n % 250 + 1}/32"
            return self._expecting(
                kind, {"prefix": prefix}, lambda: self._put_ipcache(prefix), timeout
            )
        self.port += 1
        if kind == "rule":
            return self._expecting(kind, {"port": self.port}, self._put_rule, timeout)
        if kind == "service":
            return self._expecting(kind, {"port": self.port}, self._put_service, timeout)
        raise ValueError(f"unknown change {kind!r}")

    # --- measuring ---

    def processes(self) -> dict[str, int]:
        pids = {svc: p.pid for svc, p in self.cluster.services.items()}
        assert self.cluster.etcd.proc is not None
        pids["etcd"] = self.cluster.etcd.proc.pid
        return pids

    @contextlib.contextmanager
    def usage(self, into: list[Usage]) -> Iterator[None]:
        """The CPU each process (and all node workers, as "nodes") spends
        inside the block, and their RSS at its end."""
        pids = self.processes()
        workers = [w.proc.pid for w in self.workers]
        cpu0 = {who: cpu_seconds(pid) for who, pid in pids.items()}
        nodes0 = sum(cpu_seconds(pid) for pid in workers)
        t0 = time.monotonic()
        yield
        cpu = {who: cpu_seconds(pid) - cpu0[who] for who, pid in pids.items()}
        cpu["nodes"] = sum(cpu_seconds(pid) for pid in workers) - nodes0
        rss = {who: rss_kib(pid) for who, pid in pids.items()}
        rss["nodes"] = sum(rss_kib(pid) for pid in workers)
        into.append(Usage(time.monotonic() - t0, cpu, rss))

    def etcd_counters(self) -> dict[str, float]:
        """The counters summed, and messages received per method
        ("msg_received:<method>")."""
        with urllib.request.urlopen(self.cluster.etcd.metrics_url, timeout=10) as resp:
            scrape = samples(resp.read().decode())
        out = {c: sum(v for (n, _), v in scrape.items() if n == c) for c in ETCD_COUNTERS}
        for (name, labels), v in scrape.items():
            if name == "grpc_server_msg_received_total":
                key = f"msg_received:{dict(labels)['grpc_method']}"
                out[key] = out.get(key, 0.0) + v
        return out

    def measure(self, changes: int, rest_seconds: float) -> Round:
        """At the current node count: a quiet window, then changes of each
        kind in turn (one at a time)."""
        n = len(self.nodes)
        result = Round(n, {k: [] for k in KINDS}, changes)
        load0 = loadavg()
        usages: list[Usage] = []
        before = self.etcd_counters()
        with self.usage(usages):
            time.sleep(rest_seconds)  # the window itself: nothing to wait on
        after = self.etcd_counters()
        minutes = usages[0].seconds / 60
        result.etcd_rest = {
            c: (v - before.get(c, 0.0)) / n / minutes
            for c, v in after.items()
            if c in ETCD_COUNTERS or v > before.get(c, 0.0)
        }
        for kind in KINDS:
            with self.usage(usages):
                for _ in range(changes):
                    result.latencies[kind] += self.change(kind)
            result.during[kind] = usages[-1]
        result.rest = usages[0]
        result.load = (load0, loadavg())
        self.log(
            f"{n} nodes: "
            + ", ".join(
                f"{k} p99 {percentile(v, 99) * 1e3:.0f} ms" for k, v in result.latencies.items()
            )
        )
        return result

    def close(self) -> list[int]:
        """Stop every worker; their exit codes."""
        return [w.stop() for w in self.workers]


def figures(rounds: list[Round]) -> dict[str, Any]:
    """The rounds as one flat JSON object with unit-carrying names."""
    out: dict[str, Any] = {}
    for r in rounds:
        p = f"n{r.nodes}_"
        for kind, lat in r.latencies.items():
            for q in (50, 99):
                out[f"{p}{kind}_p{q}_ms"] = round(percentile(lat, q) * 1e3, 1)
            out[f"{p}{kind}_max_ms"] = round(max(lat) * 1e3, 1)
        out[f"{p}changes_per_kind"] = r.changes
        assert r.rest is not None
        for who in r.rest.cpu:
            out[f"{p}{who}_rest_cpu_pct"] = round(100 * r.rest.cpu[who] / r.rest.seconds, 2)
            for kind, usage in r.during.items():
                # Inclusive: the process's CPU over the changes' window.
                ms = 1e3 * usage.cpu[who] / r.changes
                out[f"{p}{who}_cpu_ms_per_{kind}_change"] = round(ms, 1)
            out[f"{p}{who}_rest_rss_mib"] = round(r.rest.rss_kib[who] / 1024, 1)
            last = r.during[KINDS[-1]]
            out[f"{p}{who}_changes_rss_mib"] = round(last.rss_kib[who] / 1024, 1)
        for c, v in r.etcd_rest.items():
            short = c.removeprefix("grpc_server_").removesuffix("_total").replace(":", "_")
            out[f"{p}etcd_{short}_per_node_per_min"] = round(v, 2)
        out[f"{p}rest_s"] = round(r.rest.seconds, 1)
        out[f"{p}loadavg_start"], out[f"{p}loadavg_end"] = r.load
    return out
