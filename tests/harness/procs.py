"""flagella services as real processes: `python -m flagella.<svc>` with
flags, waited on through the gRPC health service, stopped by PID.

Every process runs with mutual TLS and its own certificate from the session
CA (a datapath: its node's), unless spawned with insecure=True (the
explicit --insecure switch: see docs/DEVELOPMENT.md for when a test may)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagella.common import pki
from flagella.common.pki import Identity
from flagella.common.tls import target_options
from harness import tls
from harness.etcd import session_pki as etcd_pki
from harness.net import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING


def health_status(
    address: str,
    service: str = "",
    timeout: float = 1.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> int | None:
    """The health status of address, or None if it does not answer
    (plaintext without credentials)."""
    ch = (
        grpc.secure_channel(address, credentials, options=target_options(address))
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with ch:
        stub: Any = health_pb2_grpc.HealthStub(ch)  # its type stubs lack Check
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return None
        return int(resp.status)


def default_identity(svc: str, args: Sequence[str]) -> Identity:
    """A service's own identity; a datapath's is its node's."""
    if svc != "datapath":
        return pki.service(svc)
    args = list(args)
    name = args[args.index("--node-name") + 1] if "--node-name" in args else socket.gethostname()
    return pki.node(name)


class ServiceProcess:
    """One flagella service process on a free loopback port."""

    def __init__(
        self,
        svc: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        log_dir: Path | None = None,
        prefix: Sequence[str] = (),
        listen: str | None = None,
        insecure: bool = False,
        identity: Identity | None = None,
        test_pki: tls.TestPki | None = None,
    ) -> None:
        self.svc = svc
        self.port = port or free_port()
        # A unix socket (unix:/path) reaches a process in another netns.
        self.address = listen or f"127.0.0.1:{self.port}"
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.prefix = list(prefix)
        log_dir = log_dir or Path(tempfile.gettempdir())
        self.log_path = log_dir / f"flagella-{svc}-{self.port}.log"
        self.returncode: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        # Its own metrics port; in a netns of its own (prefix: a node's
        # datapath) the default port, which nothing else there holds.
        self.metrics_port = 9965 if self.prefix else free_port()
        self.metrics_listen = f"127.0.0.1:{self.metrics_port}"
        # The relay's flows page, on a free port too (the test's flags win).
        self.ui_listen = f"127.0.0.1:{free_port()}" if svc == "relay" else ""
        # A datapath in the test's own netns (the host's): its pins, state,
        # CNI socket, DNS proxy port and tunnel device would be the host's defaults, which
        # the compose stack beside it uses too; its own instead, removed
        # when it stops (the test's flags win).
        self.own_paths: list[Path] = []
        if svc == "datapath" and not self.prefix:
            self.args = [*self._own_places(), *self.args]
        self.insecure = insecure or "--insecure" in self.args
        self.pki = test_pki or tls.session()
        self.identity = identity or default_identity(svc, self.args)

    def _own_places(self) -> list[str]:
        given = {a.partition("=")[0] for a in self.args if a.startswith("--")}
        out: list[str] = []
        if "--bpf-root" not in given:
            pins = Path(f"/sys/fs/bpf/fl-proc-{os.getpid()}-{self.port}")
            self.own_paths.append(pins)
            out += ["--bpf-root", str(pins)]
        if "--state-dir" not in given:
            state = Path(tempfile.mkdtemp(prefix="fl-dp-state-"))
            self.own_paths.append(state)
            out += ["--state-dir", str(state)]
        if "--cni-socket" not in given:
            sock = Path(tempfile.gettempdir()) / f"fl-dp-{os.getpid()}-{self.port}.sock"
            self.own_paths.append(sock)
            out += ["--cni-socket", str(sock)]
        if "--routing-mode" not in given:
            out += ["--routing-mode", "native"]  # no tunnel device on the host
        if "--dns-proxy-port" not in given:
            # The node default (10053) is the host's, which another test's
            # datapath in the host netns, or the compose stack, may hold.
            out += ["--dns-proxy-port", str(free_port())]
        return out

    def tls_args(self) -> list[str]:
        """Flags giving the process its certificates, for gRPC and for etcd
        (before the test's own flags, which win: --etcd-insecure for a
        plaintext etcd)."""
        grpc_args = ["--insecure"] if self.insecure else self.pki.args(self.identity)
        etcd_args = [] if self.svc in ("datapath", "relay") else etcd_pki().service_args(self.svc)
        return [*grpc_args, *etcd_args]

    def credentials(self, identity: Identity = tls.OPERATOR) -> grpc.ChannelCredentials | None:
        return None if self.insecure else self.pki.credentials(identity)

    def health(self, service: str = "", timeout: float = 1.0) -> int | None:
        """This process's health status for service (None: no answer)."""
        return health_status(self.address, service, timeout, self.credentials())

    def channel(self, identity: Identity = tls.OPERATOR) -> grpc.Channel:
        """A blocking channel to this process, as identity (an operator
        unless told), or plaintext when the process runs --insecure."""
        if self.insecure:
            return grpc.insecure_channel(self.address)
        return self.pki.channel(self.address, identity)

    def aio_channel(self, identity: Identity = tls.OPERATOR) -> grpc.aio.Channel:
        if self.insecure:
            return grpc.aio.insecure_channel(self.address)
        return self.pki.aio_channel(self.address, identity)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServiceProcess:
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            f"flagella.{self.svc}",
            "--listen",
            self.address,
            "--metrics-listen",
            self.metrics_listen,
            *(["--ui-listen", self.ui_listen] if self.ui_listen else []),
            *self.tls_args(),
            *self.args,
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def scrape(self, timeout: float = 5.0) -> str:
        """GET /metrics of this process (the Prometheus text format)."""
        url = f"http://{self.metrics_listen}/metrics"
        if self.prefix:  # from inside its netns
            fetch = f"import urllib.request as u; print(u.urlopen({url!r}).read().decode())"
            return subprocess.run(
                [*self.prefix, sys.executable, "-c", fetch],
                capture_output=True,
                text=True,
                check=True,
                timeout=timeout + 10,
            ).stdout
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.read().decode())

    def wait_serving(self, timeout: float = 30.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.svc} exited with {self.proc.returncode}:\n{self.logs()[-3000:]}"
                )
            if self.health(timeout=0.5) == SERVING:
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.svc} not SERVING after {timeout}s:\n{self.logs()[-3000:]}")

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill9(self) -> None:
        """SIGKILL and reap: a crash."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def remove_own_paths(self) -> None:
        """After its last stop: the places it was given of its own (a
        restart in between keeps them, as a node's would)."""
        for path in self.own_paths:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def cleanup(self) -> None:
        self.stop()
        self.remove_own_paths()
        self.log_path.unlink(missing_ok=True)
