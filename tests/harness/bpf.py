"""Helpers for the BPF datapath tests: a private pin folder per test, and
synthetic endpoints for BPF_PROG_TEST_RUN.

A test run happens on the loopback device of the current netns (ifindex
1), so the endpoints a packet comes from or goes to are written with
ifindex 1; a redirect's target ifindex is only recorded, not used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flagella.datapath.bpf import Datapath, MapSizes, Programs

TEST_IFINDEX = 1  # lo: the device of a test run
PIN_PREFIX = "/sys/fs/bpf/flagella-test-"


def new_pin_root() -> str:
    return f"{PIN_PREFIX}{uuid.uuid4().hex[:10]}"


@contextmanager
def private_datapath(
    programs: Programs,
    sizes: MapSizes | None = None,
    pin_root: str | None = None,
    **load: Any,
) -> Iterator[Datapath]:
    """A Datapath on its own pin folder, removed at the end even on failure
    (load: more arguments of Datapath.load)."""
    root = pin_root or new_pin_root()
    try:
        dp = Datapath.load(root, programs=programs, sizes=sizes, **load)
        try:
            yield dp
        finally:
            dp.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Pod:
    endpoint_id: int
    ip: str
    identity: int
    mac: str
    node_mac: str
    ifindex: int = TEST_IFINDEX

    def add(self, dp: Datapath) -> None:
        dp.endpoints.upsert(
            self.endpoint_id,
            [self.ip],
            ifindex=self.ifindex,
            identity=self.identity,
            mac=self.mac,
            node_mac=self.node_mac,
        )

    @property
    def mac_bytes(self) -> bytes:
        return bytes.fromhex(self.mac.replace(":", ""))

    @property
    def node_mac_bytes(self) -> bytes:
        return bytes.fromhex(self.node_mac.replace(":", ""))


POD_A = Pod(11, "10.1.0.1", 1000, "0a:00:00:00:01:01", "0a:00:00:00:01:fe")
POD_B = Pod(12, "10.1.0.2", 2000, "0a:00:00:00:02:01", "0a:00:00:00:02:fe")
POD_C = Pod(13, "10.1.0.3", 3000, "0a:00:00:00:03:01", "0a:00:00:00:03:fe")
POD_A6 = Pod(21, "fd00:1::1", 1000, "0a:00:00:00:06:01", "0a:00:00:00:06:fe")
POD_B6 = Pod(22, "fd00:1::2", 2000, "0a:00:00:00:06:02", "0a:00:00:00:06:fd")
WORLD_IP = "203.0.113.10"  # TEST-NET-3: never leaves the test run


CLONE_NEWNET = 0x40000000


@contextmanager
def inside_netns(path: str) -> Iterator[None]:
    """Runs the calling thread in the netns at path (setns(2) changes only
    the calling thread), and back to its own netns at the end: a test run
    then happens on that netns's devices and consults its FIB."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns {path}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
    finally:
        os.close(own)
