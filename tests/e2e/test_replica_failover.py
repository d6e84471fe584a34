"""Replicas of the control plane and client failover: two replicas each of
ipam, policy, lb and endpoint (real processes, one etcd); a node whose
datapath is given both replicas' sockets of each (its watch streams and the
CNI relay), the endpoint service both of ipam's and policy's TCP addresses
(mTLS verified against the service's name), policy both of lb's.

Under a continuous ADD/DEL loop through the real flagella-cni (a failed ADD
retried as containerd does: DEL, then ADD again) and probes pod -> pod and
pod -> ClusterIP, one replica of each service is killed -9 in turn and
restarted after its turn (in the background); then the other replica of
each, left dead once the first serves again (so
whichever replica a client had picked, it failed over at least once).
Every ADD succeeds, probes never fail outside a kill window, nothing leaks,
and the datapath's streams resumed on the other replica without a snapshot."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness import tls
from harness.cluster import Cluster, Node
from harness.cni import cni, netconf
from harness.etcd import EtcdServer
from harness.leaks import held, holds_only
from harness.netns import Netns, wait_until
from harness.probe import Pod, Probe, probing
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2
from flagella.common.backoff import Backoff

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

VIP = "10.96.0.30"
CLI = str(Path(sys.executable).parent / "flagella")
NODE_LEASES = "flagella/state/identities/v1/nodes/n1/"
SERVICES = ("ipam", "policy", "lb", "endpoint")
# After a kill, until the loop has gone on this many ADD/DEL cycles.
CYCLES_PER_KILL = 2
# A kill window ends this long after those cycles.
GRACE_S = 2.0
ADD_TRIES = 4


@dataclass
class Runtime:
    """flagella-cni run as containerd and the kubelet run it: an ADD
    answered "try again later" (11) is retried after a DEL (the kubelet
    keeps retrying a sandbox with a backoff; here up to ADD_TRIES times); a
    DEL is retried until it succeeds. What still failed is in errors."""

    node: Node
    retried_adds: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, name: str, ns: Netns, labels: dict[str, str]) -> Pod:
        conf = netconf(self.node.cni_socket, labels, timeout=30)
        rc, out = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=("ha", name))
        backoff = Backoff(0.2, 1.0)
        for _ in range(ADD_TRIES - 1):
            if rc == 0 or out.get("code") != 11:
                break
            self.retried_adds += 1
            self.delete(name, ns)
            time.sleep(backoff.next())
            rc, out = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=("ha", name))
        if rc != 0:
            self.errors.append(f"ADD {name}: {out}")
            return Pod(name, ns, "")
        return Pod(name, ns, str(out["ips"][0]["address"]).split("/")[0])

    def delete(self, name: str, ns: Netns) -> None:
        for _ in range(5):
            conf = netconf(self.node.cni_socket)
            rc, out = cni("DEL", conf, container_id=f"ctr-{name}", netns=ns.path)
            if rc == 0:
                return
        self.errors.append(f"DEL {name}: {out}")


@dataclass
class Churn:
    """Pods added and deleted one after the other."""

    runtime: Runtime
    netns: list[Netns]
    cycles: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            ns, name = self.netns[self.cycles % len(self.netns)], f"churn{self.cycles}"
            self.runtime.add(name, ns, {"app": "churn"})
            self.runtime.delete(name, ns)
            self.cycles += 1


def etcd_keys(etcd: EtcdServer) -> set[str]:
    async def read() -> set[str]:
        client = etcd.client()
        try:
            kvs, _ = await client.get_prefix("flagella/", keys_only=True)
        finally:
            await client.close()
        return {kv.key for kv in kvs}

    return asyncio.run(read())


def stream_snapshots(datapath: ServiceProcess) -> Counter[str]:
    """Snapshots (RESETs) each of the datapath's watch streams received."""
    lines = (json.loads(line) for line in datapath.logs().splitlines() if line.startswith("{"))
    return Counter(r["stream"] for r in lines if r.get("msg") == "watch stream snapshot")


def test_kill9_one_replica_of_each_service_under_cni_churn_and_traffic(cluster: Cluster) -> None:
    # Identities and node leases nobody references are collected within
    # seconds (two rounds), not a minute: what is left after is a leak.
    cluster.start(services=SERVICES, replicas=2, extra={"policy": ["--identity-gc-interval", "1"]})
    node = cluster.add_node("n1")
    assert node.process is not None
    runtime = Runtime(node)
    srv = runtime.add("srv", cluster.pod(node, "srv"), {"app": "srv"})
    cli = runtime.add("cli", cluster.pod(node, "cli"), {"app": "cli"})
    assert not runtime.errors, runtime.errors
    srv.ns.serve("tcp", 8080, "srv")
    cluster.lb().UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=lb_pb2.Service(
                name="churn/web",
                frontend=lb_pb2.Frontend(address=VIP, port=80, protocol=lb_pb2.PROTOCOL_TCP),
                type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
                backends=[lb_pb2.Backend(address=srv.ip, port=8080)],
            )
        ),
        timeout=10,
    )
    assert wait_until(lambda: cli.ns.request("tcp", VIP, 80, timeout=1) is not None)
    keys_before = etcd_keys(cluster.etcd)
    snapshots_before = stream_snapshots(node.process)
    assert set(snapshots_before) >= {"nodes", "ipcache", "policy", "services"}

    churn = Churn(runtime, [cluster.pod(node, f"c{i}") for i in range(2)])
    windows: list[tuple[float, float]] = []

    def kill(proc: ServiceProcess, svc: str, restart: bool) -> None:
        start = time.time()
        proc.kill9()
        done = churn.cycles + CYCLES_PER_KILL
        assert wait_until(lambda: churn.cycles >= done, timeout=30), f"churn stalled: {svc}"
        if restart:
            # Not waited on: the other replica serves; it is waited for
            # before that one's turn.
            cluster.restart(svc, kill=True, wait=False)
        windows.append((start, time.time() + GRACE_S))
        print(f"{svc} {'restarted' if restart else 'killed'}: {time.time() - start:.1f}s")

    thread = threading.Thread(target=churn.run, name="churn")
    with (
        probing({"pod": (cli, srv)}, 8080) as to_pod,
        probing({"vip": (cli, Pod("vip", srv.ns, VIP))}, 80) as to_vip,
    ):
        began = time.time()
        thread.start()
        try:
            for svc in SERVICES:
                kill(cluster.services[svc], svc, restart=True)
            for svc in SERVICES:
                cluster.services[svc].wait_serving()
                kill(cluster.replicas[svc][0], svc, restart=False)
        finally:
            churn.stop.set()
            thread.join(60)
        probes: dict[str, Probe] = {**to_pod, **to_vip}
        samples = {name: p.read() for name, p in probes.items()}

    # Every ADD succeeded, at most after the runtime's retry.
    assert not runtime.errors, runtime.errors
    assert churn.cycles >= 2 * len(SERVICES) * CYCLES_PER_KILL

    # Traffic failed only inside a kill window.
    def in_window(t: float) -> bool:
        return any(a <= t <= b for a, b in windows)

    for name, got in samples.items():
        assert len([t for t, _ in got if t >= began]) > 20, name
        outside = [t for t, ok in got if not ok and t >= began and not in_window(t)]
        assert not outside, f"{name}: {len(outside)} probes failed outside a kill window"
    failed = sum(not ok for got in samples.values() for t, ok in got if t >= began)
    total = sum(1 for got in samples.values() for t, _ in got if t >= began)
    print(
        f"\nreplica failover: {churn.cycles} ADD/DEL cycles, {runtime.retried_adds} ADDs retried "
        f"after code 11; probes failed {failed}/{total} ({100 * failed / total:.2f} %)"
    )

    # Nothing leaked: what the live pods hold and nothing else, in the
    # services, the datapath, the kernel and etcd.
    alive, labels = {"ctr-srv": srv.ip, "ctr-cli": cli.ip}, {"ctr-srv": "srv", "ctr-cli": "cli"}
    assert wait_until(lambda: holds_only(held(cluster, node), alive, labels), timeout=20), (
        json.dumps(held(cluster, node))
    )

    # Beside what was there: at most the live policy replica's own current
    # lease record for the node (where its next reference goes; the dead
    # replica's is revoked once idle), nothing else.
    def new_keys() -> list[str]:
        return sorted(etcd_keys(cluster.etcd) - keys_before)

    def no_leak() -> bool:
        new = new_keys()
        return len(new) <= 1 and all(k.startswith(NODE_LEASES) for k in new)

    assert wait_until(no_leak, timeout=20), new_keys()

    # Each stream failed over to the other replica and resumed from its
    # last revision: no snapshot beyond the first.
    assert stream_snapshots(node.process) == snapshots_before

    # The CLI, given both replicas' TCP addresses of each (one of them dead
    # now), fails over too, verifying each replica by its service's name.
    lists = [a for svc in SERVICES for a in (f"--{svc}-address", cluster.addresses(svc))]
    env = {**os.environ, "FLAGELLA_TLS_DIR": str(tls.session().bundle(tls.OPERATOR))}
    out = subprocess.run(
        [CLI, *lists, "-o", "json", "endpoint", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert {e["pod_name"] for e in json.loads(out.stdout)} == {"srv", "cli"}
