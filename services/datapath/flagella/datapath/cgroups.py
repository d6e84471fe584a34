"""The cgroups of this node's pods (GetCgroupDumpMetadata), for tools that
attach BPF programs by cgroup.

A pod is found by its network namespace, the one thing every endpoint
record has (the CNI ADD's netns path): every process whose /proc/PID/ns/net
is that namespace (same device and inode) belongs to the pod, and its
cgroup v2 path is the `0::` line of /proc/PID/cgroup. The cgroup id is what
bpf_get_current_cgroup_id() answers: the inode of the cgroup's folder under
the cgroup v2 mount (found in /proc/self/mountinfo). A pod whose namespace
no process holds (a bare `ip netns add`), a netns path that is gone, or a
node without a cgroup v2 hierarchy answers no containers and says why.
Reads /proc of the process's own PID namespace: in a container the
datapath needs the host's (hostPID) to see the pods' processes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CgroupContainer:
    cgroup_id: int
    path: str  # relative to the cgroup v2 root, starting with "/"
    pids: tuple[int, ...]


@dataclass(frozen=True)
class PodCgroups:
    endpoint_id: int
    container_id: str
    netns_path: str
    addresses: tuple[str, ...]
    containers: tuple[CgroupContainer, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class PodRef:
    """What the datapath knows of a pod (its endpoint record)."""

    endpoint_id: int
    container_id: str
    netns_path: str
    addresses: tuple[str, ...] = ()


def cgroup2_root(mountinfo: str = "/proc/self/mountinfo") -> str:
    """Where the cgroup v2 hierarchy is mounted; "" when it is not."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        # ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            return left.split(" ")[4]
    return ""


def _netns_of(proc: Path) -> dict[tuple[int, int], list[int]]:
    """(device, inode) of each process's network namespace -> its pids."""
    out: dict[tuple[int, int], list[int]] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"{entry.path}/ns/net")
        except OSError:
            continue  # gone, or a kernel thread we may not look at
        out.setdefault((st.st_dev, st.st_ino), []).append(int(entry.name))
    return out


def _cgroup_path(proc: Path, pid: int) -> str | None:
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def dump(
    pods: Iterable[PodRef], proc: str = "/proc", root: str | None = None
) -> tuple[str, list[PodCgroups]]:
    """(the cgroup v2 root, each pod's cgroups). Blocking: walks /proc."""
    procdir = Path(proc)
    root = cgroup2_root() if root is None else root
    holders = _netns_of(procdir)
    out = []
    for pod in pods:
        base = PodCgroups(pod.endpoint_id, pod.container_id, pod.netns_path, pod.addresses)
        try:
            st = os.stat(pod.netns_path)
        except OSError as exc:
            out.append(_with_error(base, f"netns {pod.netns_path}: {exc.strerror}"))
            continue
        pids = holders.get((st.st_dev, st.st_ino), [])
        if not pids:
            out.append(_with_error(base, "no process holds the pod's network namespace"))
            continue
        if not root:
            out.append(_with_error(base, "no cgroup v2 hierarchy is mounted"))
            continue
        by_path: dict[str, list[int]] = {}
        for pid in sorted(pids):
            path = _cgroup_path(procdir, pid)
            if path is not None:
                by_path.setdefault(path, []).append(pid)
        containers = []
        for path, members in sorted(by_path.items()):
            try:
                cgroup_id = os.stat(root + path).st_ino
            except OSError:
                continue  # the cgroup went away meanwhile
            containers.append(CgroupContainer(cgroup_id, path, tuple(members)))
        if containers:
            out.append(dataclasses.replace(base, containers=tuple(containers)))
        else:
            out.append(_with_error(base, "its processes are in no cgroup v2 group"))
    return root, out


def _with_error(pod: PodCgroups, error: str) -> PodCgroups:
    return dataclasses.replace(pod, error=error)
