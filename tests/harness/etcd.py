"""A real etcd server (Debian's etcd-server) on free loopback ports, with its
data in a temporary folder; stopped by PID and reaped.

Secure by default, as flagella runs it: TLS with client certificates from
the session's etcd CA (--client-cert-auth), authentication on, and the users
and roles of flagella.common.etcdauth applied. A spawned service connects as
its own etcd user (`ServiceProcess` passes its certificate); a test reads and
writes anything as root through `etcd.client()`. `EtcdServer(secure=False)`
is a plaintext etcd (services then need `--etcd-insecure`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import functools
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aetcd.exceptions

from flagella.cli.certs import etcd_client_identity
from flagella.common import etcdauth, pki
from flagella.common.errors import Unavailable
from flagella.common.etcd import Etcd
from flagella.common.tls import TlsFiles, TlsPaths
from harness.net import free_port
from harness.tls import TestPki

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
SERVER = pki.service("etcd")


class EtcdPki(TestPki):
    """The etcd CA of a test session (apart from the cluster CA, as in a
    deployment) and its bundles: etcd's server certificate, and client
    certificates whose CN is the etcd user (a service's, or root)."""

    __test__ = False

    def issue(
        self, identity: pki.Identity, lifetime: dt.timedelta = pki.LEAF_LIFETIME
    ) -> pki.Issued:
        if identity == SERVER:
            return self.ca.issue(
                identity,
                dns=("localhost",),
                ips=("127.0.0.1",),
                lifetime=lifetime,
                common_name="etcd",
            )
        user = etcdauth.ROOT if identity == ROOT else etcdauth.user_of(identity.name)
        return self.ca.issue(identity, lifetime=lifetime, common_name=user)

    def user_bundle(self, user: str) -> Path:
        """The folder of a user's client certificate: a service name or root."""
        return self.bundle(etcd_client_identity(user)[0])

    def service_args(self, svc: str) -> list[str]:
        """A service's --etcd-cert/--etcd-key/--etcd-ca flags."""
        return self.args(etcd_client_identity(svc)[0], flag="--etcd")


ROOT = etcd_client_identity(etcdauth.ROOT)[0]


@functools.cache
def session_pki() -> EtcdPki:
    """The etcd PKI of this test session, in a temporary folder removed at exit."""
    import atexit

    root = Path(tempfile.mkdtemp(prefix="flagella-etcd-pki-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return EtcdPki(root, pki.CertificateAuthority.create("flagella test etcd CA"))


class PatientEtcd(Etcd):
    """A test's own etcd client: a call whose connection could not be made
    (the request never left, so retrying is safe even for a write) is tried
    again for a few seconds. Under a loaded CI machine etcd sometimes drops
    a TLS handshake; that is not what the test is about."""

    CONNECT_RETRY_S = 10.0

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.CONNECT_RETRY_S
        delay = 0.05
        while True:
            try:
                return await super()._call(fn, *args, **kwargs)
            except Unavailable as exc:
                never_sent = isinstance(exc.__cause__, aetcd.exceptions.ConnectionFailedError) or (
                    "failed to connect to all addresses" in exc.message
                )
                if not never_sent or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


class EtcdServer:
    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        secure: bool = True,
        apply_auth: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """secure: TLS and client certificates; apply_auth: then also the
        users and roles, auth on (else etcd's auth is off until a test
        applies it); extra_args: more etcd flags (the soak's compaction)."""
        self.extra_args = extra_args
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="flagella-etcd-"))
        self.client_port = self.peer_port = self.metrics_port = 0
        self.pick_ports()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.with_suffix(".log")
        self.secure = secure
        self.pki = session_pki()
        self._auth_applied = not apply_auth
        # A member of an EtcdCluster: its name and the cluster's peers.
        self.name = "test"
        self.initial_cluster = ""
        self.timing = ("10", "50")  # heartbeat, election timeout (ms)

    def pick_ports(self) -> None:
        self.client_port = free_port()
        self.peer_port = free_port()
        self.metrics_port = free_port()

    @property
    def port_taken(self) -> bool:
        """It exited because a port picked as free was taken meanwhile (by
        another test process: free_port can only say what is free now)."""
        return (
            self.proc is not None
            and self.proc.poll() is not None
            and "address already in use" in self.log_path.read_text(errors="replace")
        )

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def metrics_url(self) -> str:
        """etcd's Prometheus metrics, plaintext (read-only, as usual)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def client(self, user: str = etcdauth.ROOT, *, timeout: float = 5.0) -> Etcd:
        """A client of this etcd as user (root, or a service's user)."""
        if not self.secure:
            return PatientEtcd([self.endpoint], timeout=timeout)
        files = TlsFiles(TlsPaths.in_dir(self.pki.user_bundle(user)))
        return PatientEtcd([self.endpoint], timeout=timeout, tls_files=files)

    def service_args(self, svc: str) -> list[str]:
        """A service's flags for its etcd credentials here."""
        return self.pki.service_args(svc) if self.secure else ["--etcd-insecure"]

    def _tls_flags(self) -> list[str]:
        if not self.secure:
            return []
        folder = self.pki.bundle(SERVER)
        return [
            "--cert-file", str(folder / pki.CERT_FILE),
            "--key-file", str(folder / pki.KEY_FILE),
            "--trusted-ca-file", str(folder / pki.CA_FILE),
            "--client-cert-auth",
        ]  # fmt: skip

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, timeout: float = 10.0) -> EtcdServer:
        fresh = not (self.data_dir / "data").exists()
        for attempt in range(3):
            self.launch()
            try:
                return self.wait_ready(timeout)
            except RuntimeError:
                # A port taken between picking and binding (another test
                # process): a new server starts over on other ports.
                if attempt == 2 or not fresh or self.initial_cluster or not self.port_taken:
                    raise
                self.stop(kill=True)
                shutil.rmtree(self.data_dir / "data", ignore_errors=True)
                self.pick_ports()
        raise AssertionError("unreachable")

    def launch(self) -> None:
        """Start the process (wait_ready waits for it to answer)."""
        scheme = "https" if self.secure else "http"
        client = f"{scheme}://127.0.0.1:{self.client_port}"
        peer = self.peer_url
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    ETCD,
                    *self._tls_flags(),
                    "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
                    "--name", self.name,
                    "--data-dir", str(self.data_dir / "data"),
                    "--listen-client-urls", client,
                    "--advertise-client-urls", client,
                    "--listen-peer-urls", peer,
                    "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
                    "--heartbeat-interval", self.timing[0],
                    "--election-timeout", self.timing[1],
                    "--logger", "zap",
                    "--log-level", "warn",
                    *self.extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def wait_ready(self, timeout: float = 10.0) -> EtcdServer:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), 0.2):
                    pass
            except OSError:
                time.sleep(0.02)
                continue
            if self._healthy():
                if self.secure and not self._auth_applied:
                    self._apply_auth()
                return self
            time.sleep(0.02)
        raise RuntimeError("etcd did not come up")

    def _apply_auth(self) -> None:
        """The users and roles of flagella.common.etcdauth, auth enabled
        (in a thread: a test may start etcd inside its event loop)."""

        async def apply() -> None:
            # Idempotent: tried again when etcd dropped the connection's
            # handshake (as PatientEtcd does for a test's own calls).
            deadline = time.monotonic() + PatientEtcd.CONNECT_RETRY_S
            while True:
                etcd = self.client()
                try:
                    await etcdauth.apply(etcd)
                    return
                except etcdauth.EtcdAuthError as exc:
                    if "failed to connect" not in str(exc) or time.monotonic() > deadline:
                        raise
                finally:
                    await etcd.close()
                await asyncio.sleep(0.2)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, apply()).result()
        self._auth_applied = True

    def _healthy(self) -> bool:
        import urllib.request

        context = None
        if self.secure:
            folder = self.pki.user_bundle(etcdauth.ROOT)
            context = ssl.create_default_context(cafile=str(folder / pki.CA_FILE))
            context.load_cert_chain(folder / pki.CERT_FILE, folder / pki.KEY_FILE)
        scheme = "https" if self.secure else "http"
        try:
            url = f"{scheme}://127.0.0.1:{self.client_port}/health"
            with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)


class EtcdCluster:
    """Several etcd members (real processes) as one cluster, secure as
    EtcdServer (users and roles applied once through the first member).
    A member is killed and restarted by itself: `members[i].stop(kill=True)`,
    `members[i].start()` (its data folder stays)."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.members = [EtcdServer(root / f"etcd-m{i}", apply_auth=False) for i in range(size)]
        for i, member in enumerate(self.members):
            member.name = f"m{i}"
            # Elections in a quarter second, not in 50 ms: three members
            # share two loaded cores with the services.
            member.timing = ("25", "250")
        self._peers()
        self.pki = session_pki()

    def _peers(self) -> None:
        peers = ",".join(f"m{i}={m.peer_url}" for i, m in enumerate(self.members))
        for member in self.members:
            member.initial_cluster = peers

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        for attempt in range(3):
            for member in self.members:  # together: none is ready before a quorum
                member.launch()
            try:
                for member in self.members:
                    member.wait_ready(timeout)
                break
            except RuntimeError:
                # A port taken between picking and binding: the cluster is
                # new, so start it over on other ports (another test
                # process runs beside this one).
                if attempt == 2 or not any(m.port_taken for m in self.members):
                    raise
                for member in self.members:
                    member.stop(kill=True)
                    shutil.rmtree(member.data_dir / "data", ignore_errors=True)
                    member.pick_ports()
                self._peers()
        self.members[0]._apply_auth()
        for member in self.members:
            member._auth_applied = True
        return self

    def client(self, user: str = etcdauth.ROOT, *, timeout: float = 5.0) -> Etcd:
        files = TlsFiles(TlsPaths.in_dir(self.pki.user_bundle(user)))
        return PatientEtcd(self.endpoints, timeout=timeout, tls_files=files)

    def cleanup(self) -> None:
        for member in self.members:
            member.cleanup()
