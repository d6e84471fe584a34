"""A real etcd server (Debian's etcd-server) on free loopback ports, with its
data in a temporary folder; stopped by PID and reaped."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from harness.net import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


class EtcdServer:
    def __init__(self, data_dir: Path | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="flagella-etcd-"))
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.with_suffix(".log")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 10.0) -> EtcdServer:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    ETCD,
                    "--name", "test",
                    "--data-dir", str(self.data_dir / "data"),
                    "--listen-client-urls", client,
                    "--advertise-client-urls", client,
                    "--listen-peer-urls", peer,
                    "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"test={peer}",
                    "--heartbeat-interval", "10",
                    "--election-timeout", "50",
                    "--logger", "zap",
                    "--log-level", "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
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
                return self
            time.sleep(0.02)
        raise RuntimeError("etcd did not come up")

    def _healthy(self) -> bool:
        import urllib.request

        try:
            url = f"http://127.0.0.1:{self.client_port}/health"
            with urllib.request.urlopen(url, timeout=1) as resp:
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
