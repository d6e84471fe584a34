"""Network namespaces the tests create (pods, nodes, an outside host) and the
traffic between them. Traffic never leaves namespaces the test made.

Servers and clients are small Python programs run inside a netns with
`nsenter --net=` (not `ip netns exec`, which remounts /sys and hides bpffs).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

NETNS_DIR = Path("/run/netns")

# Answers every TCP connection / UDP datagram with "<name> <peer ip> <data>".
SERVER = r"""
import socket, sys, threading
proto, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
family = socket.AF_INET6 if len(sys.argv) > 4 and sys.argv[4] == "6" else socket.AF_INET
if proto == "tcp":
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port)); s.listen(128)
    print("ready", flush=True)
    def serve(c, peer):
        with c:
            c.settimeout(30)
            try:
                while True:
                    data = c.recv(4096)
                    if not data:
                        return
                    if data.startswith(b"ECHO"):
                        c.sendall(data)
                    else:
                        c.sendall(f"{name} {peer[0]} {data.decode().strip()}\n".encode())
            except OSError:
                return
    while True:
        c, peer = s.accept()
        threading.Thread(target=serve, args=(c, peer), daemon=True).start()
else:
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    print("ready", flush=True)
    while True:
        data, peer = s.recvfrom(4096)
        s.sendto(f"{name} {peer[0]} {data.decode().strip()}".encode(), peer)
"""

# One request; prints the server's answer, exits 1 when none came.
CLIENT = r"""
import socket, sys
proto, host, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
family = socket.AF_INET6 if ":" in host else socket.AF_INET
try:
    if proto == "tcp":
        s = socket.create_connection((host, port), timeout=timeout)
        s.sendall(b"HELLO\n")
        print(s.recv(4096).decode().strip())
    else:
        s = socket.socket(family, socket.SOCK_DGRAM); s.settimeout(timeout)
        s.sendto(b"HELLO", (host, port))
        print(s.recvfrom(4096)[0].decode().strip())
except OSError as e:
    print(f"error {e}", file=sys.stderr); sys.exit(1)
"""

# Many TCP connections; prints a JSON list of answers (None for failures).
MANY = r"""
import json, socket, sys
host, port, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
out = []
for i in range(n):
    try:
        s = socket.create_connection((host, port), timeout=timeout)
        s.sendall(b"HELLO\n")
        out.append(s.recv(4096).decode().strip()); s.close()
    except OSError:
        out.append(None)
print(json.dumps(out))
"""

# A long-lived TCP stream: echo round trips every interval; prints one line
# per round trip ("ok N" or "fail N reason") until killed. With "hello", it
# first says HELLO and prints the first word of the answer (which backend
# of a service holds the connection).
STREAM = r"""
import socket, sys, time
host, port, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((host, port), timeout=5)
s.settimeout(5)
if sys.argv[4:] == ["hello"]:
    s.sendall(b"HELLO\n"); print(s.recv(4096).decode().split()[0], flush=True)
i = 0
while True:
    i += 1
    msg = f"ECHO {i}\n".encode()
    try:
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            chunk = s.recv(4096)
            if not chunk:
                raise OSError("closed")
            got += chunk
        print(f"ok {i}" if got == msg else f"fail {i} mismatch", flush=True)
    except OSError as e:
        print(f"fail {i} {e}", flush=True)
        break
    time.sleep(interval)
"""


def run(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=check)


class Netns:
    """A network namespace under /run/netns, deleted by cleanup()."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = str(NETNS_DIR / name)
        self._procs: list[subprocess.Popen[str]] = []

    def create(self) -> Netns:
        run("ip", "netns", "add", self.name)
        run("ip", "-n", self.name, "link", "set", "lo", "up")
        return self

    def cmd(self, *args: str) -> list[str]:
        return ["nsenter", f"--net={self.path}", *args]

    def run(
        self, *args: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        return run(*self.cmd(*args), check=check, timeout=timeout)

    def ip(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run("ip", "-n", self.name, *args)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            self.cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._procs.append(proc)
        return proc

    def link(self, name: str) -> dict[str, object]:
        data: list[dict[str, object]] = json.loads(self.ip("-j", "link", "show", name).stdout)
        return data[0]

    # --- traffic ---

    def serve(self, proto: str, port: int, name: str, *, v6: bool = False) -> subprocess.Popen[str]:
        proc = self.popen(sys.executable, "-c", SERVER, proto, str(port), name, "6" if v6 else "4")
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"server in {self.name} did not start: {line}")
        return proc

    def request(self, proto: str, host: str, port: int, timeout: float = 2.0) -> str | None:
        """The server's answer ("<server name> <client ip as seen> HELLO"),
        or None when nothing came back."""
        out = self.run(
            sys.executable,
            "-c",
            CLIENT,
            proto,
            host,
            str(port),
            str(timeout),
            check=False,
            timeout=timeout + 20,
        )
        return out.stdout.strip() if out.returncode == 0 else None

    def requests(self, host: str, port: int, n: int, timeout: float = 2.0) -> list[str | None]:
        out = self.run(
            sys.executable,
            "-c",
            MANY,
            host,
            str(port),
            str(n),
            str(timeout),
            timeout=n * (timeout + 1) + 30,
        )
        answers: list[str | None] = json.loads(out.stdout)
        return answers

    def ping(self, host: str, timeout: float = 2.0) -> bool:
        out = self.run(
            "ping",
            "-c",
            "1",
            "-W",
            str(int(max(timeout, 1))),
            host,
            check=False,
            timeout=timeout + 10,
        )
        return out.returncode == 0

    def stream(
        self, host: str, port: int, interval: float = 0.05, *, hello: bool = False
    ) -> subprocess.Popen[str]:
        args = [host, str(port), str(interval)] + (["hello"] if hello else [])
        return self.popen(sys.executable, "-u", "-c", STREAM, *args)

    def cleanup(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self._procs.clear()
        run("ip", "netns", "del", self.name, check=False)


class NetnsSet:
    """Namespaces of one test, all named with one random tag."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.all: list[Netns] = []

    def new(self, role: str) -> Netns:
        ns = Netns(f"fl-{self.tag}-{role}").create()
        self.all.append(ns)
        return ns

    def cleanup(self) -> None:
        for ns in reversed(self.all):
            ns.cleanup()


@contextlib.contextmanager
def namespaces() -> Iterator[NetnsSet]:
    nss = NetnsSet()
    try:
        yield nss
    finally:
        nss.cleanup()


def at_once(probes: Mapping[str, Callable[[], bool]]) -> dict[str, bool]:
    """Every probe at the same time (each a process in a namespace, most of
    their time spent waiting for an answer or a timeout), by name."""
    with concurrent.futures.ThreadPoolExecutor(len(probes) or 1) as pool:
        futures = {name: pool.submit(probe) for name, probe in probes.items()}
        return {name: f.result() for name, f in futures.items()}


def wait_until(predicate: object, timeout: float = 20.0, interval: float = 0.1) -> bool:
    """Poll predicate() until it is truthy or timeout; returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        ok = predicate()  # type: ignore[operator]
        if ok or time.monotonic() >= deadline:
            return bool(ok)
        time.sleep(interval)
