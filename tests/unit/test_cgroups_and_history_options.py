"""The datapath's cgroup walk over a /proc and a cgroup v2 tree made in a
folder (pods found through the namespaces their processes hold), the
cgroup v2 mount found in a mountinfo, and the bounds of --map-event-history
and --flow-buffer-capacity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.datapath import cgroups
from flagella.datapath.config import MAX_FLOW_BUFFER, MAX_MAP_EVENT_HISTORY, DatapathConfig


def _proc(root: Path, pid: int, netns: Path | None, cgroup: str) -> None:
    d = root / str(pid)
    (d / "ns").mkdir(parents=True)
    if netns is not None:
        os.link(netns, d / "ns" / "net")  # the same inode: the same namespace
    (d / "cgroup").write_text(f"4:memory:/elsewhere\n0::{cgroup}\n")


def test_pods_cgroups_from_the_processes_holding_their_netns(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    netns = tmp_path / "netns"
    netns.mkdir()
    for name in ("web", "idle"):
        (netns / name).write_text("")
    for path in ("pod1/sandbox", "pod1/app"):
        (cg / path).mkdir(parents=True)
    _proc(proc, 10, netns / "web", "/pod1/sandbox")
    _proc(proc, 11, netns / "web", "/pod1/app")
    _proc(proc, 12, netns / "web", "/pod1/app")
    _proc(proc, 13, None, "/other")  # no namespace readable: left out
    (proc / "self").mkdir()  # not a pid
    pods = [
        cgroups.PodRef(1, "ctr-web", str(netns / "web"), ("10.0.0.5",)),
        cgroups.PodRef(2, "ctr-idle", str(netns / "idle")),
        cgroups.PodRef(3, "ctr-gone", str(netns / "gone")),
    ]
    root, got = cgroups.dump(pods, proc=str(proc), root=str(cg))
    assert root == str(cg)
    web, idle, gone = got
    assert [(c.cgroup_id, c.path, c.pids) for c in web.containers] == [
        (os.stat(cg / "pod1/app").st_ino, "/pod1/app", (11, 12)),
        (os.stat(cg / "pod1/sandbox").st_ino, "/pod1/sandbox", (10,)),
    ]
    assert (web.endpoint_id, web.addresses, web.error) == (1, ("10.0.0.5",), "")
    assert (idle.containers, idle.error) == ((), "no process holds the pod's network namespace")
    assert gone.error.startswith(f"netns {netns / 'gone'}: ")
    _, (web_again, *_) = cgroups.dump(pods, proc=str(proc), root="")
    assert web_again.error == "no cgroup v2 hierarchy is mounted"


def test_the_cgroup2_mount_from_mountinfo(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "25 30 0:23 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "26 25 0:24 / /sys/fs/cgroup/cpu rw shared:9 - cgroup cgroup rw,cpu\n"
        "35 25 0:33 / /sys/fs/cgroup/unified rw shared:10 - cgroup2 cgroup2 rw\n"
    )
    assert cgroups.cgroup2_root(str(info)) == "/sys/fs/cgroup/unified"
    info.write_text("25 30 0:23 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n")
    assert cgroups.cgroup2_root(str(info)) == ""
    assert cgroups.cgroup2_root(str(tmp_path / "missing")) == ""


@pytest.mark.parametrize("value", ["-1", str(MAX_MAP_EVENT_HISTORY + 1)])
def test_map_event_history_out_of_bounds_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="--map-event-history"):
        load_config(
            DatapathConfig,
            prog="flagella-datapath",
            env_prefix="FLAGELLA_DATAPATH_",
            argv=["--map-event-history", value],
            environ={},
        )
    ok = load_config(
        DatapathConfig,
        prog="flagella-datapath",
        env_prefix="FLAGELLA_DATAPATH_",
        argv=["--map-event-history", "0"],
        environ={},
    )
    assert ok.map_event_history == 0


@pytest.mark.parametrize("value", ["0", str(MAX_FLOW_BUFFER + 1)])
def test_flow_buffer_capacity_out_of_bounds_is_refused(value: str) -> None:
    def load(v: str) -> DatapathConfig:
        return load_config(
            DatapathConfig,
            prog="flagella-datapath",
            env_prefix="FLAGELLA_DATAPATH_",
            argv=["--flow-buffer-capacity", v],
            environ={},
        )

    with pytest.raises(ConfigError, match="--flow-buffer-capacity"):
        load(value)
    assert load("1").flow_buffer_capacity == 1
