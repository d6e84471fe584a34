"""Loopback ports for test servers."""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct TCP ports free on host right now: each socket is held
    until all are picked (free_port() called n times may give one port
    twice, which a compose stack publishing both refuses)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def wait_port_closed(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) != 0
