"""The engine of bench/services_vs_kubeproxy.py: the same client and backend
pods (network namespaces, made once) served by kube-proxy's iptables mode,
its nftables mode (tests/harness/kubeproxy.py) and flagella (real etcd,
policy, lb and a node's datapath), one after the other; per mode and
service count: connect latency, connections/s, time to program all
services and time for one change to take effect."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.api.lb.v1 import lb_pb2_grpc
from harness.cluster import Cluster, Node, standalone_cluster
from harness.kubeproxy import PORT, TARGET_PORT, IptablesProxy, NftProxy, PlainNode, Svc
from harness.netns import Netns, NetnsSet
from harness.pods import add_pod

CLIENTS = 4  # the rate's parallel clients; the first measures latency, the second the change
BACKENDS = 8
CLIENT_IP = "10.203.0.{k}"  # k = 2..
BACKEND_IP = "10.203.0.{k}"  # k = 10..
NEW_BACKEND = ("bnew", "10.203.0.30")  # in no service until the one change

# Answers each connection with its name and closes: one round trip of data
# per connection, the accept loop in one thread (a backlog of thousands).
SERVER = r"""
import socket, sys
port, name = int(sys.argv[1]), sys.argv[2].encode() + b"\n"
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port)); s.listen(4096)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.sendall(name)
    except OSError:
        pass
    c.close()
"""

# lat FILE COUNT: COUNT new connections to random services of FILE (lines
# "vip backend,backend"), connect() timed; rate FILE SECONDS: as many as
# fit; watch VIP NAME: connections until NAME answers ("ready" after the
# first answer, then the wall time NAME answered). Answers from a backend
# not of the service count as wrong.
CLIENT = r"""
import json, random, socket, struct, sys, time
mode = sys.argv[1]
# Closed by a reset: no TIME_WAIT socket is left in the client (thousands of
# them made every later connect() slower, whatever the proxy).
RESET = struct.pack("ii", 1, 0)
def once(vip):
    t0 = time.perf_counter()
    try:
        s = socket.create_connection((vip, 80), timeout=3)
    except OSError:
        return None, None
    took = time.perf_counter() - t0
    try:
        s.settimeout(3); got = s.recv(64).decode().split()
    except OSError:
        got = []
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
    s.close()
    return took, got[0] if got else None
if mode == "watch":
    vip, want = sys.argv[2], sys.argv[3]
    ready, end = False, time.monotonic() + 30
    while time.monotonic() < end:
        _, who = once(vip)
        if who and not ready:
            ready = True; print("ready", flush=True)
        if who == want:
            print(time.time(), flush=True); sys.exit(0)
    print("timeout", flush=True); sys.exit(1)
svcs = [(l.split()[0], set(l.split()[1].split(","))) for l in open(sys.argv[2])]
rng = random.Random()
lat, fail, wrong, count = [], 0, 0, 0
t0 = time.perf_counter()
if mode == "lat":
    todo = lambda: count < int(sys.argv[3])
else:
    end = t0 + float(sys.argv[3]); todo = lambda: time.perf_counter() < end
while todo():
    vip, names = rng.choice(svcs)
    took, who = once(vip)
    count += 1
    if who is None:
        fail += 1
    elif who not in names:
        wrong += 1
    elif mode == "lat":
        lat.append(took)
print(json.dumps({"lat": lat, "fail": fail, "wrong": wrong, "count": count,
                  "elapsed": time.perf_counter() - t0}))
"""


def vip(i: int) -> str:
    return f"10.{96 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}"


def backend_ip(b: int) -> str:
    return BACKEND_IP.format(k=10 + b)


def layout(n: int, backends: int) -> list[Svc]:
    """n services, 2-4 backends each (of the backend pods), deterministic."""
    return [
        Svc(
            i,
            vip(i),
            tuple(backend_ip((i + j) % backends) for j in range(min(2 + i % 3, backends))),
        )
        for i in range(n)
    ]


def backend_name(ip: str) -> str:
    return NEW_BACKEND[0] if ip == NEW_BACKEND[1] else f"b{int(ip.rsplit('.', 1)[1]) - 10}"


class Mode(Protocol):
    name: str

    def program(self, services: Sequence[Svc]) -> float: ...
    def change(self, svc: Svc) -> None: ...
    def reset(self) -> None: ...


@dataclass
class Pods:
    """The client and backend pods, each (netns, ip), servers running."""

    clients: list[tuple[Netns, str]]
    backends: list[tuple[Netns, str]]

    @property
    def all(self) -> list[tuple[Netns, str]]:
        return [*self.clients, *self.backends]


def make_pods(nss: NetnsSet, clients_n: int, backends_n: int) -> Pods:
    clients = [(nss.new(f"c{k}"), CLIENT_IP.format(k=2 + k)) for k in range(clients_n)]
    backends = [(nss.new(f"b{b}"), backend_ip(b)) for b in range(backends_n)]
    backends.append((nss.new("bnew"), NEW_BACKEND[1]))
    for ns, ip in backends:
        proc = ns.popen(sys.executable, "-u", "-c", SERVER, str(TARGET_PORT), backend_name(ip))
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"server in {ns.name} did not start")
    return Pods(clients, backends)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def measure(
    mode: Mode, pods: Pods, n: int, samples: int, seconds: float, tmp: Path
) -> dict[str, Any]:
    """One mode at n services: program them, then latency, rate, one change."""
    services = layout(n, len(pods.backends) - 1)
    out: dict[str, Any] = {"program_s": round(mode.program(services), 3)}
    listing = tmp / f"services-{mode.name}-{n}.txt"
    listing.write_text(
        "".join(f"{s.vip} {','.join(backend_name(b) for b in s.backends)}\n" for s in services)
    )
    client = pods.clients[0][0]
    lat = json.loads(
        client.run(
            sys.executable,
            "-c",
            CLIENT,
            "lat",
            str(listing),
            str(samples),
            timeout=samples * 4 + 30,
        ).stdout
    )
    procs = [
        ns.popen(sys.executable, "-c", CLIENT, "rate", str(listing), str(seconds))
        for ns, _ in pods.clients
    ]
    rates = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    out.update(
        connect_p50_us=round(statistics.median(lat["lat"]) * 1e6, 1),
        connect_p99_us=round(pct(lat["lat"], 0.99) * 1e6, 1),
        connect_samples=len(lat["lat"]),
        connections_per_s=round(sum(r["count"] / r["elapsed"] for r in rates), 1),
        failed_connections=lat["fail"] + sum(r["fail"] for r in rates),
        wrong_backend_answers=lat["wrong"] + sum(r["wrong"] for r in rates),
    )
    out["change_ms"] = one_change(mode, pods, services[(n // 2) // 3 * 3])
    listing.unlink()
    log(f"{mode.name} at {n}: {json.dumps(out)}")  # kept should the run be cut short
    return out


def one_change(mode: Mode, pods: Pods, svc: Svc) -> float | None:
    """The new backend added to svc: ms from the write to a connection
    answered by it (None: not within 30 s)."""
    changed = Svc(svc.index, svc.vip, (*svc.backends, NEW_BACKEND[1]))
    watch = pods.clients[1][0].popen(
        sys.executable, "-u", "-c", CLIENT, "watch", svc.vip, NEW_BACKEND[0]
    )
    assert watch.stdout is not None
    if watch.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{mode.name}: service {svc.vip} does not answer")
    t0 = time.time()
    mode.change(changed)
    line = watch.stdout.readline().strip()
    watch.wait(5)
    return None if line in ("timeout", "") else round((float(line) - t0) * 1e3, 1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class FlagellaMode:
    """Services through the lb API (UpsertServices, 500 a call, two calls in
    flight), programmed by the node's datapath from its WatchServices."""

    name = "flagella"
    BATCH = 500

    def __init__(self, cluster: Cluster, node: Node) -> None:
        self.cluster = cluster
        self.lb = cluster.lb()
        self.dp = cluster.datapath(node)
        self.base = self.entries()
        self.services: list[Svc] = []
        self.pids = {
            "lb": cluster.services["lb"].pid,
            # policy follows lb's services too (toServices).
            "policy": cluster.services["policy"].pid,
            "etcd": cluster.etcd.proc.pid if cluster.etcd.proc else 0,
            "datapath": node.process.pid if node.process else 0,
        }
        self.cpu_ms_per_service: dict[str, float] = {}
        self.bpf_root = Path(node.bpf_root)

    def entries(self) -> int:
        maps = self.dp.ListMaps(datapath_pb2.ListMapsRequest(), timeout=30).maps
        return next(m.entries for m in maps if m.name == "services")

    @staticmethod
    def proto(svc: Svc) -> pb.Service:
        return pb.Service(
            name=f"bench/s{svc.index}",
            frontend=pb.Frontend(address=svc.vip, port=PORT, protocol=pb.PROTOCOL_TCP),
            type=pb.SERVICE_TYPE_CLUSTER_IP,
            algorithm=pb.ALGORITHM_RANDOM,
            backends=[pb.Backend(address=b, port=TARGET_PORT) for b in svc.backends],
        )

    async def _calls(self, requests: Sequence[Any], method: str, in_flight: int) -> None:
        async with self.cluster.services["lb"].aio_channel() as ch:
            stub = lb_pb2_grpc.LoadBalancerServiceStub(ch)
            sem = asyncio.Semaphore(in_flight)

            async def one(request: Any) -> None:
                async with sem:
                    await getattr(stub, method)(request, timeout=120)

            await asyncio.gather(*(one(r) for r in requests))

    def wait_entries(self, want: int, since: float) -> float:
        """Seconds from since until the services map holds want entries
        (a frontend entry and one slot per backend per service)."""
        while self.entries() != want:
            if time.perf_counter() - since > 600:
                raise RuntimeError(f"services map never reached {want} entries")
            time.sleep(0.05)
        return time.perf_counter() - since

    def program(self, services: Sequence[Svc]) -> float:
        self.services = list(services)
        want = self.base + sum(1 + len(s.backends) for s in services)
        requests = [
            pb.UpsertServicesRequest(services=[self.proto(s) for s in services[i : i + self.BATCH]])
            for i in range(0, len(services), self.BATCH)
        ]
        cpu0 = {who: cpu_seconds(p) for who, p in self.pids.items() if p}
        t0 = time.perf_counter()
        asyncio.run(self._calls(requests, "UpsertServices", 2))
        took = self.wait_entries(want, t0)
        self.cpu_ms_per_service = {
            who: round((cpu_seconds(self.pids[who]) - c0) * 1e3 / len(services), 3)
            for who, c0 in cpu0.items()
        }
        return took

    def change(self, svc: Svc) -> None:
        self.lb.UpsertService(pb.UpsertServiceRequest(service=self.proto(svc)), timeout=30)

    def reset(self) -> None:
        requests = [pb.DeleteServiceRequest(name=f"bench/s{s.index}") for s in self.services]
        asyncio.run(self._calls(requests, "DeleteService", 32))
        self.wait_entries(self.base, time.perf_counter())
        self.services = []


@contextlib.contextmanager
def kube_proxy(nss: NetnsSet, pods: Pods, which: str) -> Iterator[tuple[Mode, list[int]]]:
    """A plain node wired to the pods, with kube-proxy's rules of one mode;
    yields the mode and a list that receives what was left after removal
    (iptables chains or nft tables of ours: 0); the node goes at the end,
    the pods stay (unwired)."""
    node = PlainNode(nss, f"kp{which[:3]}", pods.all)
    proxy = IptablesProxy(node) if which == "iptables" else NftProxy(node)
    left: list[int] = []
    try:
        yield proxy, left
    finally:
        left.append(proxy.remove())
        node.remove()


@contextlib.contextmanager
def flagella(tmp: Path, pods: Pods, verdict_events: str = "all") -> Iterator[FlagellaMode]:
    """etcd, policy, lb and one node's datapath (its --verdict-events as
    given); the pods set up on it as the endpoint service would
    (SetupEndpoint in their netns)."""
    with standalone_cluster(tmp) as cluster:
        cluster.start(services=("policy", "lb"))
        node = cluster.add_node("svc", extra=("--verdict-events", verdict_events))
        for k, (ns, ip) in enumerate(pods.all):
            add_pod(cluster, node, ns.name, k + 1, ip, {"app": "bench"}, ns=ns)
        yield FlagellaMode(cluster, node)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_all(
    counts: Sequence[int],
    samples: int,
    seconds: float,
    tmp: Path,
    modes: Sequence[str] = ("iptables", "nftables", "flagella"),
    pod_counts: tuple[int, int] = (CLIENTS, BACKENDS),
    verdict_events: str = "all",
) -> dict[str, Any]:
    """Every mode at every count; figures keyed <mode>_<n>_<figure>, plus
    ratios flagella / each kube-proxy mode, and what was left behind.
    verdict_events: the datapath's --verdict-events."""
    out: dict[str, Any] = {}
    random.seed(0)
    nss = NetnsSet()
    try:
        pods = make_pods(nss, *pod_counts)
        for which in modes:
            if which == "flagella":
                continue
            with kube_proxy(nss, pods, which) as (proxy, left):
                for n in counts:
                    log(f"{which}: {n} services")
                    for k, v in measure(proxy, pods, n, samples, seconds, tmp).items():
                        out[f"{which}_{n}_{k}"] = v
                    if n != counts[-1]:  # the last goes with the node
                        proxy.reset()
            out[f"{which}_rules_left_after_cleanup"] = left[0]
        if "flagella" in modes:
            log("flagella: starting etcd, policy, lb, the datapath, the pods")
            out["flagella_verdict_events"] = verdict_events
            with flagella(tmp, pods, verdict_events) as fl:
                for n in counts:
                    log(f"flagella: {n} services")
                    for k, v in measure(fl, pods, n, samples, seconds, tmp).items():
                        out[f"flagella_{n}_{k}"] = v
                    for who, ms in fl.cpu_ms_per_service.items():
                        out[f"flagella_{n}_program_cpu_{who}_ms_per_service"] = ms
                    if n != counts[-1]:  # the last goes with the cluster
                        fl.reset()
            out["bpf_pins_left"] = int(fl.bpf_root.exists())
    finally:
        nss.cleanup()
    out["netns_left"] = sum(1 for p in Path("/run/netns").glob(f"fl-{nss.tag}-*"))
    add_ratios(out, counts, modes)
    return out


# Figure -> its name in a ratio (a ratio has no unit).
RATIOS = {
    "connect_p50_us": "connect_p50",
    "connect_p99_us": "connect_p99",
    "connections_per_s": "connection_rate",
    "program_s": "program_time",
    "change_ms": "change_time",
}


def add_ratios(out: dict[str, Any], counts: Sequence[int], modes: Sequence[str]) -> None:
    if "flagella" not in modes:
        return
    for peer in (m for m in modes if m != "flagella"):
        for n in counts:
            for fig, name in RATIOS.items():
                a, b = out.get(f"flagella_{n}_{fig}"), out.get(f"{peer}_{n}_{fig}")
                if a is not None and b:
                    out[f"ratio_flagella_vs_{peer}_{n}_{name}"] = round(a / b, 3)
