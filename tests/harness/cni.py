"""Running flagella-cni as a container runtime runs it: CNI_* environment,
the network configuration on stdin, a JSON result or error on stdout."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from flagella.common import pki
from flagella.datapath.cnirelay import CniRelay
from harness import tls

PLUGIN = shutil.which("flagella-cni", path=str(Path(sys.executable).parent)) or "flagella-cni"
# The self-contained plugin the datapath image installs on nodes.
BUNDLE_BUILDER = Path(__file__).resolve().parents[2] / "docker" / "datapath" / "cni_bundle.py"


def plugin() -> str:
    """The flagella-cni that cni() runs: $FLAGELLA_CNI_PLUGIN (a bundle a
    benchmark built: build_bundle), or the venv's script."""
    return os.environ.get("FLAGELLA_CNI_PLUGIN") or PLUGIN


def build_bundle(out: Path) -> str:
    """Build the plugin's self-contained bundle (docker/datapath/cni_bundle.py,
    as the datapath image does) into out; the path of its flagella-cni."""
    subprocess.run(
        [sys.executable, str(BUNDLE_BUILDER), str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return str(out / "flagella-cni")


def netconf(socket: str, labels: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """A network config for the node whose datapath serves `socket`."""
    conf: dict[str, Any] = {
        "cniVersion": "1.1.0",
        "name": "flagella",
        "type": "flagella-cni",
        "socket": socket,
        "timeout": 60,
    }
    if labels is not None:
        conf["args"] = {"cni": {"labels": labels}}
    conf.update(extra)
    return conf


@contextlib.contextmanager
def node_relay(endpoint_address: str, node: str) -> Iterator[str]:
    """A node's side of flagella-cni without its datapath (which needs root
    and BPF): the datapath's own relay (flagella.datapath.cnirelay) on a
    socket of its own, on an event loop in a thread, relaying to the
    endpoint service at endpoint_address as `node` (with node's certificate
    from the session's PKI). Yields the socket path."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="cni-relay", daemon=True)
    thread.start()
    folder = tempfile.mkdtemp(prefix="flcni-")  # short: unix socket paths max 107 bytes
    path = f"{folder}/cni.sock"

    async def start() -> tuple[CniRelay, grpc.aio.Channel]:
        channel = tls.session().aio_channel(endpoint_address, pki.node(node))
        relay = CniRelay(path, node, endpoint_address, channel)
        await relay.open()
        return relay, channel

    async def stop(relay: CniRelay, channel: grpc.aio.Channel) -> None:
        await relay.close()
        await channel.close()

    try:
        relay, channel = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        try:
            yield path
        finally:
            asyncio.run_coroutine_threadsafe(stop(relay, channel), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        shutil.rmtree(folder, ignore_errors=True)


def cni(
    command: str,
    conf: dict[str, Any],
    *,
    container_id: str = "",
    netns: str = "",
    ifname: str = "eth0",
    pod: tuple[str, str] | None = None,
    timeout: float = 90,
) -> tuple[int, dict[str, Any]]:
    """(exit status, parsed stdout; {} when it printed nothing)."""
    env = {"PATH": os.environ.get("PATH", ""), "CNI_COMMAND": command, "CNI_PATH": "/opt/cni/bin"}
    if container_id:
        env["CNI_CONTAINERID"] = container_id
    if netns:
        env["CNI_NETNS"] = netns
    if ifname:
        env["CNI_IFNAME"] = ifname
    if pod:
        env["CNI_ARGS"] = f"IgnoreUnknown=1;K8S_POD_NAMESPACE={pod[0]};K8S_POD_NAME={pod[1]}"
    proc = subprocess.run(
        [plugin()],
        input=json.dumps(conf).encode(),
        capture_output=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    out = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, out


def add_pod(
    socket: str, netns: str, name: str, namespace: str, labels: dict[str, str]
) -> tuple[str, str]:
    """`flagella-cni ADD` of pod namespace/name (container ctr-<name>) in
    netns through the node's socket: its IPv4 and IPv6 addresses ("" for
    a family it has none of)."""
    rc, result = cni(
        "ADD",
        netconf(socket, labels),
        container_id=f"ctr-{name}",
        netns=netns,
        pod=(namespace, name),
    )
    assert rc == 0, result
    ips = [ipaddress.ip_interface(ip["address"]).ip for ip in result["ips"]]
    ip4 = next((str(ip) for ip in ips if ip.version == 4), "")
    ip6 = next((str(ip) for ip in ips if ip.version == 6), "")
    return ip4, ip6


def check_result(result: dict[str, Any], *, netns: str, ifname: str, pod_cidr: str) -> str:
    """Validate an ADD result against the CNI 1.1.0 result schema (the
    fields and their types/relations) and return the pod's IPv4 address."""
    assert result["cniVersion"] == "1.1.0"
    interfaces = result["interfaces"]
    assert isinstance(interfaces, list)
    assert interfaces
    for iface in interfaces:
        assert isinstance(iface["name"], str)
        assert iface["name"]
        assert len(iface["mac"].split(":")) == 6
    sandboxed = [i for i, iface in enumerate(interfaces) if iface.get("sandbox")]
    assert len(sandboxed) == 1
    assert interfaces[sandboxed[0]]["sandbox"] == netns
    assert interfaces[sandboxed[0]]["name"] == ifname
    ips = result["ips"]
    assert ips
    for ip in ips:
        iface = ipaddress.ip_interface(ip["address"])
        assert isinstance(ip["interface"], int)
        assert 0 <= ip["interface"] < len(interfaces)
        assert ip["interface"] == sandboxed[0]
        if "gateway" in ip:
            ipaddress.ip_address(ip["gateway"])
        if iface.version == 4:
            assert iface.ip in ipaddress.ip_network(pod_cidr)
    for route in result.get("routes", []):
        ipaddress.ip_network(route["dst"])
        if "gw" in route:
            ipaddress.ip_address(route["gw"])
    assert isinstance(result.get("dns", {}), dict)
    v4 = next(ip["address"] for ip in ips if ipaddress.ip_interface(ip["address"]).version == 4)
    return str(ipaddress.ip_interface(v4).ip)
