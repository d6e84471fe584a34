"""The five services as processes on one etcd, each on its own loopback
port: the control plane and one datapath (as root, with a pin folder of its
own and no IP forwarding: it touches nothing else on the host)."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.etcd import EtcdServer
from harness.procs import ServiceProcess


def control_plane(
    spawn: Callable[..., ServiceProcess], etcd: EtcdServer
) -> dict[str, ServiceProcess]:
    """ipam, policy, lb and endpoint on etcd (each as its etcd user)."""
    common = ("--etcd-endpoints", etcd.endpoint)
    ipam = spawn("ipam", *common, "--cluster-cidr", "10.244.0.0/16")
    policy = spawn("policy", *common)
    lb = spawn("lb", *common)
    endpoint = spawn(
        "endpoint", *common, "--ipam-address", ipam.address, "--policy-address", policy.address
    )
    return {"ipam": ipam, "policy": policy, "lb": lb, "endpoint": endpoint}


@contextlib.contextmanager
def five_services(
    spawn: Callable[..., ServiceProcess], etcd: EtcdServer, tmp: Path, node: str
) -> Iterator[dict[str, ServiceProcess]]:
    """{name: process}; the datapath is node's. Its pins are removed at the end."""
    services = control_plane(spawn, etcd)
    pins = f"/sys/fs/bpf/fl-suite-{uuid.uuid4().hex[:6]}"
    try:
        datapath = spawn(
            "datapath",
            "--node-name", node,
            "--bpf-root", pins,
            "--state-dir", str(tmp / f"dp-{node}"),
            "--no-enable-ip-forward",
        )  # fmt: skip
        yield {**services, "datapath": datapath}
        datapath.stop()
    finally:
        shutil.rmtree(pins, ignore_errors=True)
