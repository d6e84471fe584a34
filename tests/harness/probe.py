"""Pods probing pods continuously with new TCP connections (each a new
flow, so conntrack never hides a change), every sample timed: how a test
sees when traffic under policy turns allowed or dropped, and that it stays."""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from harness.netns import Netns, wait_until

# New connections, one after the other; prints "<start time> ok|fail" each.
PROBE = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
while True:
    t = time.time()
    try:
        s = socket.create_connection((host, port), timeout=0.3)
        # Policy decided on the handshake; the answer only needs the
        # server's thread, which a loaded machine may keep waiting.
        s.settimeout(2.0)
        s.sendall(b"HELLO\n")
        ok = bool(s.recv(4096))
        s.close()
    except OSError:
        ok = False
    print(f"{t:.3f} {'ok' if ok else 'fail'}", flush=True)
    time.sleep(0.03)
"""


@dataclass
class Pod:
    name: str
    ns: Netns
    ip: str


class Probe:
    """A client pod connecting to a server pod's port over and over."""

    def __init__(self, client: Pod, server: Pod, port: int) -> None:
        self.proc = client.ns.popen(sys.executable, "-u", "-c", PROBE, server.ip, str(port))
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._rest = ""
        self.samples: list[tuple[float, bool]] = []

    def read(self) -> list[tuple[float, bool]]:
        """Every sample so far (reads what the probe printed)."""
        buf = self._rest
        while select.select([self._fd], [], [], 0)[0]:
            chunk = os.read(self._fd, 65536).decode()
            if not chunk:
                break
            buf += chunk
        *lines, self._rest = buf.split("\n")
        for line in lines:
            t, verdict = line.split()
            self.samples.append((float(t), verdict == "ok"))
        return self.samples

    def since(self, t: float) -> list[bool]:
        """The verdicts of the samples started at or after t."""
        return [ok for at, ok in self.read() if at >= t]

    def settled(self, since: float, ok: bool, hold: float = 0.5) -> float | None:
        """When the samples started after since turned ok (or not) for good
        (at least hold seconds of them), or None yet."""
        samples = [s for s in self.read() if s[0] >= since]
        if not samples or samples[-1][0] - since < hold:
            return None
        turned = None
        for t, verdict in samples:
            if verdict != ok:
                turned = None
            elif turned is None:
                turned = t
        if turned is None or samples[-1][0] - turned < hold:
            return None
        return turned - since


@contextlib.contextmanager
def probing(pairs: Mapping[str, tuple[Pod, Pod]], port: int) -> Iterator[dict[str, Probe]]:
    """A probe per name, from its client pod to its server pod's port, for
    the duration."""
    probes = {name: Probe(client, server, port) for name, (client, server) in pairs.items()}
    try:
        yield probes
    finally:
        for p in probes.values():
            p.proc.kill()
            p.proc.wait(5)


def settle(
    probes: Mapping[str, Probe],
    since: float,
    want: Mapping[str, bool],
    what: str,
    within: float,
    timeout: float = 10,
) -> None:
    """Each probe named in want turns to its verdict within `within`
    seconds of since, and stays."""
    assert wait_until(
        lambda: all(probes[k].settled(since, ok) is not None for k, ok in want.items()), timeout
    ), what
    for k, ok in want.items():
        took = probes[k].settled(since, ok)
        assert took is not None
        assert took <= within, f"{what}: {k} took {took:.2f}s"
