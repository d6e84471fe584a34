"""A flagella cluster on one machine: etcd and the control-plane services as
processes in the host netns, and nodes as network namespaces, each with its
own datapath process (own pin folder, state folder and uplink to an
"outside" netns). Processes talk over unix sockets, which cross netns
boundaries; nothing is routed outside the machine."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from flagella.api.datapath.v1 import datapath_pb2_grpc
from flagella.api.endpoint.v1 import endpoint_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2_grpc
from flagella.common.pki import Identity
from harness import tls
from harness.etcd import EtcdServer
from harness.kube_api import KubeListWatchServer
from harness.net import free_port
from harness.netns import Netns, NetnsSet
from harness.procs import ServiceProcess
from harness.underlay import Underlay

Spawn = Callable[..., ServiceProcess]
OUTSIDE_IP = "192.168.{n}.254"
NODE_IP = "192.168.{n}.1"


@dataclass
class Node:
    name: str
    index: int
    netns: Netns
    outside: Netns
    ip: str
    socket: str
    # Where its datapath serves flagella-cni (the network config's "socket").
    cni_socket: str
    bpf_root: str
    state_dir: Path
    args: list[str]
    process: ServiceProcess | None = None
    pods: dict[str, Netns] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"


class Cluster:
    def __init__(self, tmp: Path, etcd: EtcdServer, spawn: Spawn, nss: NetnsSet) -> None:
        self.tmp = tmp
        self.etcd = etcd
        self.spawn = spawn
        self.nss = nss
        self.tag = uuid.uuid4().hex[:6]
        self.sock = Path(f"/tmp/fl-{self.tag}")  # short: unix socket paths max 107 bytes
        self.sock.mkdir()
        self.services: dict[str, ServiceProcess] = {}
        # The second and further replicas of a service (start(replicas=N)).
        self.replicas: dict[str, list[ServiceProcess]] = {}
        self.service_args: dict[str, list[str]] = {}
        self.nodes: dict[str, Node] = {}
        self._channels: list[grpc.Channel] = []

    def socket(self, svc: str, replica: int = 0) -> str:
        return f"unix:{self.sock}/{svc}{f'-{replica}' if replica else ''}.sock"

    def sockets(self, svc: str) -> str:
        """Every replica's socket, as a datapath's address option lists them."""
        return ",".join(self.socket(svc, i) for i in range(1 + len(self.replicas.get(svc, []))))

    def addresses(self, svc: str) -> str:
        """Every replica's TCP address (host:port,host:port)."""
        procs = [self.services[svc], *self.replicas.get(svc, [])]
        return ",".join(p.address for p in procs)

    def start(
        self,
        services: Sequence[str] = ("ipam", "policy", "lb"),
        extra: dict[str, list[str]] | None = None,
        replicas: int = 1,
    ) -> Cluster:
        """The control plane, in dependency order; replicas processes of
        each service (same etcd), each on its own port and socket, its
        clients given every replica's address."""
        extra = extra or {}
        common = ["--etcd-endpoints", self.etcd.endpoint]
        # lb starts after policy, which follows it (toServices): its ports now.
        lb_ports = [free_port() for _ in range(replicas)]
        for svc in ("ipam", "policy", "lb", "endpoint"):
            if svc not in services:
                continue
            args = [*common, *extra.get(svc, [])]
            if svc == "ipam":
                args += ["--cluster-cidr", "10.200.0.0/16"]
            if svc == "policy":
                lbs = ",".join(f"127.0.0.1:{p}" for p in lb_ports)
                args += ["--lb-address", lbs if "lb" in services else ""]
            if svc == "endpoint":
                args += [
                    "--ipam-address", self.addresses("ipam"),
                    "--policy-address", self.addresses("policy"),
                ]  # fmt: skip
            more = self.replicas.setdefault(svc, [])
            for i in range(1, replicas):  # started beside the first, waited on after it
                port = {"port": lb_ports[i]} if svc == "lb" else {}
                listen = ["--extra-listen", self.socket(svc, i)]
                more.append(self.spawn(svc, *args, *listen, wait=False, **port))
            self.service_args[svc] = [*args, "--extra-listen", self.socket(svc)]
            port = {"port": lb_ports[0]} if svc == "lb" else {}
            self.services[svc] = self.spawn(svc, *self.service_args[svc], **port)
            for proc in more:
                proc.wait_serving()
        return self

    def kill9(self, svc: str) -> None:
        self.services[svc].kill9()

    def restart(
        self, svc: str, extra: Sequence[str] = (), *, kill: bool = False, wait: bool = True
    ) -> ServiceProcess:
        """Stop (or kill -9) a control-plane service and start it again on the
        same address, with extra flags added for this run."""
        old = self.services[svc]
        if kill:
            old.kill9()
        else:
            old.stop()
        self.services[svc] = self.spawn(
            svc, *self.service_args[svc], *extra, port=old.port, wait=wait
        )
        return self.services[svc]

    def add_node(
        self,
        name: str,
        *,
        extra: Sequence[str] = (),
        start: bool = True,
        underlay: Underlay | None = None,
    ) -> Node:
        """A node netns with an uplink to its own outside netns (or, given
        an underlay, to that shared segment: IPv4 and IPv6 node IPs), and
        its datapath process."""
        index = len(self.nodes) + 1
        netns = self.nss.new(f"n{index}")
        node_ips: list[str] = []
        if underlay is None:
            outside = self.nss.new(f"o{index}")
            ip = NODE_IP.format(n=100 + index)
            out_ip = OUTSIDE_IP.format(n=100 + index)
            netns.ip(
                "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", outside.name
            )
            netns.ip("addr", "add", f"{ip}/24", "dev", "up0")
            netns.ip("link", "set", "up0", "up")
            outside.ip("addr", "add", f"{out_ip}/24", "dev", "eth0")
            outside.ip("link", "set", "eth0", "up")
        else:
            outside = underlay.outside
            ip, ip6 = underlay.plug(netns, index, "up0")
            node_ips.append(ip6)
        node = Node(
            name=name,
            index=index,
            netns=netns,
            outside=outside,
            ip=ip,
            socket=f"{self.sock}/dp-{name}.sock",
            cni_socket=f"{self.sock}/cni-{name}.sock",
            bpf_root=f"/sys/fs/bpf/fl-test-{self.tag}-{name}",
            state_dir=self.tmp / f"state-{name}",
            args=[],
        )
        args = [
            "--node-name", name,
            "--node-ip", ip,
            *(a for ip6 in node_ips for a in ("--node-ip", ip6)),
            "--uplink", "up0",
            "--bpf-root", node.bpf_root,
            "--state-dir", str(node.state_dir),
        ]  # fmt: skip
        for svc in ("ipam", "policy", "lb", "endpoint"):
            if svc in self.services:
                args += [f"--{svc}-address", self.sockets(svc)]
        if "endpoint" in self.services:
            args += ["--cni-socket", node.cni_socket]
        node.args = [*args, *extra]
        self.nodes[name] = node
        if start:
            self.start_datapath(node)
        return node

    def start_datapath(self, node: Node, wait: bool = True) -> ServiceProcess:
        node.process = self.spawn(
            "datapath",
            *node.args,
            prefix=["nsenter", f"--net={node.netns.path}"],
            listen=node.address,
            wait=wait,
        )
        return node.process

    def pod(self, node: Node, name: str) -> Netns:
        ns = self.nss.new(f"{node.index}{name}")
        node.pods[name] = ns
        return ns

    # --- stubs ---

    def channel(self, address: str, as_: Identity = tls.OPERATOR) -> grpc.Channel:
        """A channel presenting as_'s certificate (an operator's unless told)."""
        ch = tls.session().channel(address, as_)
        self._channels.append(ch)
        return ch

    def ipam(self, as_: Identity = tls.OPERATOR) -> ipam_pb2_grpc.IpamServiceStub:
        return ipam_pb2_grpc.IpamServiceStub(self.channel(self.services["ipam"].address, as_))

    def policy(self, as_: Identity = tls.OPERATOR) -> policy_pb2_grpc.PolicyServiceStub:
        return policy_pb2_grpc.PolicyServiceStub(self.channel(self.services["policy"].address, as_))

    def lb(self, as_: Identity = tls.OPERATOR) -> lb_pb2_grpc.LoadBalancerServiceStub:
        return lb_pb2_grpc.LoadBalancerServiceStub(self.channel(self.services["lb"].address, as_))

    def endpoint(self, as_: Identity = tls.OPERATOR) -> endpoint_pb2_grpc.EndpointServiceStub:
        return endpoint_pb2_grpc.EndpointServiceStub(
            self.channel(self.services["endpoint"].address, as_)
        )

    def datapath(
        self, node: Node, as_: Identity = tls.OPERATOR
    ) -> datapath_pb2_grpc.DatapathServiceStub:
        return datapath_pb2_grpc.DatapathServiceStub(self.channel(node.address, as_))

    def cleanup(self) -> None:
        for ch in self._channels:
            ch.close()
        for node in self.nodes.values():
            if node.process is not None:
                node.process.stop()
        for node in self.nodes.values():
            shutil.rmtree(node.bpf_root, ignore_errors=True)
        shutil.rmtree(self.sock, ignore_errors=True)


@contextlib.contextmanager
def standalone_cluster(
    tmp: Path, log_level: str = "warning", etcd_args: tuple[str, ...] = ()
) -> Iterator[Cluster]:
    """A Cluster outside pytest (benchmarks): its own etcd (with etcd_args),
    processes and namespaces, all removed on exit."""
    started: list[ServiceProcess] = []

    def spawn(svc: str, *args: str, wait: bool = True, **kwargs: Any) -> ServiceProcess:
        proc = ServiceProcess(svc, [*args, "--log-level", log_level], log_dir=tmp, **kwargs)
        started.append(proc)
        proc.start()
        if wait:
            proc.wait_serving(60)
        return proc

    etcd = EtcdServer(tmp / f"etcd-{uuid.uuid4().hex[:6]}", extra_args=etcd_args).start()
    nss = NetnsSet()
    cluster = Cluster(tmp, etcd, spawn, nss)
    try:
        yield cluster
    finally:
        cluster.cleanup()
        for proc in reversed(started):
            proc.stop()
        nss.cleanup()
        etcd.cleanup()


# Leader election in seconds, not tens: a test's watchers lead at once.
KUBE_LEADER = ["--leader-lease-duration", "2", "--leader-renew-deadline", "1.5",
               "--leader-retry-period", "0.25"]  # fmt: skip


@contextlib.contextmanager
def kube_cluster(
    tmp: Path,
    namespaces: Mapping[str, Mapping[str, str]],
    policy_args: Sequence[str] = (),
) -> Iterator[tuple[KubeListWatchServer, Cluster]]:
    """A standalone cluster (ipam, policy, endpoint) whose policy and endpoint
    services follow a stand-in API server holding these namespaces (name ->
    labels); add its nodes with add_node."""
    with KubeListWatchServer() as kube_api, standalone_cluster(tmp, "info") as cluster:
        for name, labels in namespaces.items():
            kube_api.apply("namespaces", {"metadata": {"name": name, "labels": dict(labels)}})
        kubeconfig = ["--kubeconfig", str(kube_api.write_kubeconfig(tmp / "kubeconfig")),
                      *KUBE_LEADER]  # fmt: skip
        cluster.start(
            services=("ipam", "policy", "endpoint"),
            extra={"policy": [*kubeconfig, *policy_args], "endpoint": kubeconfig},
        )
        yield kube_api, cluster


def cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """The flagella CLI as an operator against the cluster's policy service."""
    command = shutil.which("flagella", path=str(Path(sys.executable).parent)) or "flagella"
    return subprocess.run(
        [
            command,
            "--tls-dir", str(tls.session().bundle(tls.OPERATOR)),
            "--policy-address", cluster.services["policy"].address,
            *args,
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
