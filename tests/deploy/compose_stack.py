"""flagella under Docker Compose for tests: the Docker engine (started here when
none answers, stopped again by PID), the images built from this tree on a
local debootstrap base (no registry is reachable), and compose.yaml brought up
with stand-ins for etcd and Jaeger (and Debian's Prometheus) on free loopback
ports and a free subnet."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.net import free_ports

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SERVICES = ("ipam", "policy", "endpoint", "lb", "datapath")
# Every gRPC server of the stack: the five (which `flagella status` and
# Prometheus know) and the flow relay.
SERVERS = (*SERVICES, "relay")
GRPC_SERVICE = {
    "ipam": "flagella.ipam.v1.IpamService",
    "policy": "flagella.policy.v1.PolicyService",
    "endpoint": "flagella.endpoint.v1.EndpointService",
    "lb": "flagella.lb.v1.LoadBalancerService",
    "datapath": "flagella.datapath.v1.DatapathService",
    "relay": "flagella.relay.v1.RelayService",
}
IMAGE_PREFIX = "flagella-test"
# The compose datapath's node (its certificate names it).
NODE_NAME = "compose-test-node"
# Kept between runs (they only speed up the next one): the debootstrap base
# (named by a hash of its inputs) and the flagella base with the wheels.
CACHED_IMAGES = ("flagella-test-debootstrap", "flagella-test-base")


def sh(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        list(cmd), env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and res.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        )
    return res


class DockerDaemon:
    """The Docker engine: the one that answers, or one started here.

    A daemon started here touches the host as little as dockerd can: no
    iptables rules, no ip_forward change, no default bridge (compose makes
    its own network; image builds run with --network=none). It is stopped by
    its PID at the end; one that was already running is left alone."""

    def __init__(self, log_dir: Path) -> None:
        self.log_path = log_dir / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def answers() -> bool:
        return sh(["docker", "info"], check=False, timeout=30).returncode == 0

    def start(self) -> DockerDaemon:
        if self.answers():
            return self
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                ["dockerd", "--iptables=false", "--ip-forward=false", "--bridge=none"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited:\n{self.log_path.read_text()[-3000:]}")
            if self.answers():
                return self
            time.sleep(0.3)
        raise RuntimeError(f"dockerd did not answer:\n{self.log_path.read_text()[-3000:]}")

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    def server_version(self) -> tuple[int, ...]:
        out = sh(["docker", "version", "--format", "{{.Server.Version}}"]).stdout.strip()
        return tuple(int(p) for p in re.findall(r"\d+", out)[:2])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


PIN_ROOT = Path("/sys/fs/bpf/flagella")
TUNNEL_DEVICE = "flagella_vxlan"


def host_artefacts() -> set[str]:
    """What a datapath in the host's network namespace leaves on the host
    after it stops (as `scripts/down` without --purge): its pins, its tunnel
    device."""
    found = set()
    if PIN_ROOT.exists():
        found.add(str(PIN_ROOT))
    if sh(["ip", "link", "show", TUNNEL_DEVICE], check=False).returncode == 0:
        found.add(TUNNEL_DEVICE)
    return found


def remove_host_artefacts(*, keep: set[str]) -> None:
    """Remove those the stack made (not those there before it)."""
    made = host_artefacts() - keep
    if str(PIN_ROOT) in made:
        shutil.rmtree(PIN_ROOT, ignore_errors=True)
    if TUNNEL_DEVICE in made:
        sh(["ip", "link", "del", TUNNEL_DEVICE], check=False)


def ensure_shared_netns_dir() -> None:
    """compose.yaml mounts /run/netns with rslave propagation, which needs it
    to be a shared mount. iproute2 makes it one the first time a named netns
    is added; do exactly that with a throw-away netns if nobody has yet."""
    mountinfo = Path("/proc/self/mountinfo").read_text()
    if re.search(r" /run/netns .*shared:", mountinfo):
        return
    name = f"flagella-test-{os.getpid()}"
    sh(["ip", "netns", "add", name])
    sh(["ip", "netns", "del", name])


def used_networks() -> list[ipaddress.IPv4Network]:
    nets: list[ipaddress.IPv4Network] = []
    for line in sh(["ip", "-4", "route", "show"]).stdout.splitlines():
        dst = line.split()[0]
        if dst != "default":
            nets.append(ipaddress.IPv4Network(dst, strict=False))
    ids = sh(["docker", "network", "ls", "-q"]).stdout.split()
    if ids:
        out = sh(
            [
                "docker",
                "network",
                "inspect",
                "--format",
                "{{range .IPAM.Config}}{{.Subnet}} {{end}}",
                *ids,
            ]
        ).stdout
        for subnet in out.split():
            net = ipaddress.ip_network(subnet, strict=False)
            if isinstance(net, ipaddress.IPv4Network):
                nets.append(net)
    return nets


def free_compose_net() -> str:
    """The first three octets of a 172.29.x.0/24 no route or network uses."""
    used = used_networks()
    start = os.getpid() % 200
    for i in range(256):
        third = (start + i) % 256
        candidate = ipaddress.IPv4Network(f"172.29.{third}.0/24")
        if not any(candidate.overlaps(n) for n in used):
            return f"172.29.{third}"
    raise RuntimeError("no free 172.29.x.0/24 for the compose network")


def ipam_implements_register_node() -> bool:
    """Whether this tree's ipam servicer overrides RegisterNode (the generated
    base class answers UNIMPLEMENTED). The datapath only becomes ready once
    ipam registered its node, so without it the stack runs the datapath
    without registration."""
    from flagella.api.ipam.v1 import ipam_pb2_grpc
    from flagella.ipam.servicer import IpamServicer

    return bool(IpamServicer.RegisterNode is not ipam_pb2_grpc.IpamServiceServicer.RegisterNode)


@dataclass
class ComposeStack:
    project: str
    images: dict[str, str]
    env: dict[str, str]
    files: list[str]
    ports: dict[str, int]
    net: str
    registers_node: bool
    tls_dir: Path
    etcd_tls_dir: Path
    removed_images: list[str] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        return f"{self.net}.1"

    def address(self, svc: str) -> str:
        """Where a service answers from this host: the published loopback port,
        or, for the datapath (host network), the address it listens on."""
        if svc == "datapath":
            return f"{self.gateway}:{self.ports['datapath']}"
        return f"127.0.0.1:{self.ports[svc]}"

    def compose(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        files = [a for f in self.files for a in ("-f", f)]
        return sh(
            ["docker", "compose", "-p", self.project, *files, *args],
            env=self.env,
            check=check,
            timeout=timeout,
        )

    def up(self) -> None:
        res = self.compose("up", "-d", "--wait", "--wait-timeout", "240", check=False, timeout=400)
        if res.returncode != 0:
            logs = self.compose("logs", "--no-color", "--tail", "40", check=False).stdout
            ps = self.compose("ps", "-a", check=False).stdout
            self.down()
            raise RuntimeError(f"compose up failed:\n{res.stderr[-3000:]}\n{ps}\n{logs[-8000:]}")

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {
            kind: sh(["docker", kind, "ls", "-q", "--filter", label, *extra]).stdout.split()
            for kind, extra in (("container", ["-a"]), ("network", []), ("volume", []))
        }

    def tls(self, kind: str = "operator", name: str = "compose") -> Path:
        """The folder of an identity's certificate (tls.crt, tls.key, ca.crt)
        that the stack's certs service issued."""
        return self.tls_dir / kind / name

    def etcd_tls(self, name: str) -> Path:
        """The folder of an etcd certificate the certs service issued:
        server, root, or a service's (its etcd user's)."""
        return self.etcd_tls_dir / name

    def grpcurl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """grpcurl as the stack's operator."""
        t = self.tls()
        creds = [
            "-cacert",
            str(t / "ca.crt"),
            "-cert",
            str(t / "tls.crt"),
            "-key",
            str(t / "tls.key"),
        ]
        return sh([str(VENV_BIN / "grpcurl"), *creds, *args], check=check, timeout=30)

    def channel(self, svc: str, kind: str = "operator", name: str = "compose") -> Any:
        """A grpc channel to svc with an identity's certificate."""
        import grpc

        t = self.tls(kind, name)
        creds = grpc.ssl_channel_credentials(
            (t / "ca.crt").read_bytes(), (t / "tls.key").read_bytes(), (t / "tls.crt").read_bytes()
        )
        return grpc.secure_channel(self.address(svc), creds)

    def remove_images(self) -> None:
        """Remove the images this run built (tagged per run), but the cached
        bases, and the untagged flagella images a rebuilt base left behind."""
        for name, ref in self.images.items():
            if ref.split(":")[0] in CACHED_IMAGES or name == "os":
                continue
            if sh(["docker", "rmi", ref], check=False).returncode == 0:
                self.removed_images.append(ref)
        sh(
            [
                "docker",
                "image",
                "prune",
                "-f",
                "--filter",
                "dangling=true",
                "--filter",
                "label=io.flagella.built-by=scripts/images",
            ],
            check=False,
        )


def build_images(tag: str) -> dict[str, str]:
    out = sh(
        [
            str(ROOT / "scripts" / "images"),
            "--debootstrap",
            "--prefix",
            IMAGE_PREFIX,
            "--tag",
            tag,
            "--base-tag",
            "cache",
            "--standins",
            "--json",
            "-q",
        ],
        env={**os.environ, "FLAGELLA_VENV": str(VENV_BIN.parent)},
        timeout=1200,
    ).stdout
    images: dict[str, str] = json.loads(out.strip().splitlines()[-1])
    return images


# scripts/test names the images of a run and builds them while ruff and mypy
# run (prewarm below): the compose test's own build then only finds them.
TAG_ENV = "FLAGELLA_COMPOSE_TEST_TAG"


def run_tag() -> str:
    return os.environ.get(TAG_ENV) or f"run{os.getpid()}"


def prewarm() -> None:
    """Build this run's images with a Docker engine of its own, stopped after."""
    setup_docker()
    log_dir = tmp_log_dir()
    docker = DockerDaemon(log_dir).start()
    try:
        build_images(run_tag())
    finally:
        docker.stop()
        cleanup_log_dir(log_dir)


def start_stack(docker: DockerDaemon) -> ComposeStack:
    tag = run_tag()
    images = build_images(tag)
    ensure_shared_netns_dir()
    names = ("etcd", "ipam", "policy", "endpoint", "lb", "datapath", "relay", "relay_ui")
    names += ("otlp", "jaeger_ui", "prometheus")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    net = free_compose_net()
    registers = ipam_implements_register_node()
    # The certs service's folder (root-owned keys: cleaned up by the caller).
    tls_dir = Path(tempfile.mkdtemp(prefix="flagella-compose-tls-"))
    etcd_tls_dir = Path(tempfile.mkdtemp(prefix="flagella-compose-etcd-tls-"))
    env = {
        **os.environ,
        "DOCKER_CONFIG": str(VENV_BIN.parent / "docker"),
        "FLAGELLA_IMAGE_PREFIX": IMAGE_PREFIX,
        "FLAGELLA_TAG": tag,
        "FLAGELLA_ETCD_IMAGE": images["etcd"],
        "FLAGELLA_JAEGER_IMAGE": images["jaeger"],
        "FLAGELLA_PULL_POLICY": "never",
        "FLAGELLA_COMPOSE_NET": net,
        "FLAGELLA_ETCD_PORT": str(ports["etcd"]),
        "FLAGELLA_IPAM_PORT": str(ports["ipam"]),
        "FLAGELLA_POLICY_PORT": str(ports["policy"]),
        "FLAGELLA_ENDPOINT_PORT": str(ports["endpoint"]),
        "FLAGELLA_LB_PORT": str(ports["lb"]),
        "FLAGELLA_DATAPATH_PORT": str(ports["datapath"]),
        "FLAGELLA_RELAY_PORT": str(ports["relay"]),
        "FLAGELLA_RELAY_UI_PORT": str(ports["relay_ui"]),
        "FLAGELLA_OTLP_PORT": str(ports["otlp"]),
        "FLAGELLA_JAEGER_UI_PORT": str(ports["jaeger_ui"]),
        "FLAGELLA_PROMETHEUS_PORT": str(ports["prometheus"]),
        "FLAGELLA_COMPOSE_TLS_DIR": str(tls_dir),
        "FLAGELLA_COMPOSE_ETCD_TLS_DIR": str(etcd_tls_dir),
        "FLAGELLA_NODE_NAME": NODE_NAME,
    }
    if not registers:
        env["FLAGELLA_DATAPATH_IPAM_ADDRESS"] = ""
    files = [str(ROOT / "compose.yaml")]
    if docker.server_version() < (23, 0):
        files.append(str(ROOT / "compose.docker20.yaml"))
    stack = ComposeStack(
        project=f"flagella-test-{os.getpid()}",
        images=images,
        env=env,
        files=files,
        ports=ports,
        net=net,
        registers_node=registers,
        tls_dir=tls_dir,
        etcd_tls_dir=etcd_tls_dir,
    )
    try:
        stack.up()
    except BaseException:
        stack.remove_images()
        shutil.rmtree(tls_dir, ignore_errors=True)
        shutil.rmtree(etcd_tls_dir, ignore_errors=True)
        raise
    return stack


def setup_docker() -> None:
    sh([str(ROOT / "scripts" / "setup-docker")], timeout=900)


def tmp_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="flagella-compose-test-"))


def cleanup_log_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["--prewarm"]:
        raise SystemExit("usage: compose_stack.py --prewarm")
    prewarm()
