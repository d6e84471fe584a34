"""Loopback ports for test servers."""

from __future__ import annotations

import contextlib
import random
import socket

# Below the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port
# picked here and bound a moment later by a service is not taken meanwhile
# by an outgoing connection of some other process, as a port the kernel
# picked (bind to port 0) can be (CI saw a restarted service lose its
# metrics port so: two pytest processes run side by side).
LOWEST_PORT = 10_000


def _unassigned_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return range(LOWEST_PORT, max(low, LOWEST_PORT + 1_000))


def _bind_free(host: str, taken: set[int]) -> socket.socket:
    """A socket bound to a free port of the unassigned range."""
    ports = _unassigned_ports()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(1_000):
        port = random.choice(ports)
        if port in taken:
            continue
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            continue
        return s
    raise RuntimeError(f"no free TCP port on {host} in {ports}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now, outside the kernel's ephemeral
    range."""
    with _bind_free(host, set()) as s:
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct TCP ports free on host right now: each socket is held
    until all are picked (free_port() called n times may give one port
    twice, which a compose stack publishing both refuses)."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(n):
            s = held.enter_context(_bind_free(host, set(ports)))
            ports.append(int(s.getsockname()[1]))
        return ports


def wait_port_closed(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) != 0
