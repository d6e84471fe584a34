"""flagella-cni run as a container runtime runs it: environment, config on
stdin, a spec result or error object on stdout. The plugin talks only to its
node's socket, served here by the datapath's relay (in this process) in
front of a real endpoint service and etcd."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from harness.cni import node_relay
from harness.etcd import EtcdServer
from harness.net import free_port
from harness.procs import ServiceProcess

import flagella.cni
from flagella.datapath.cnirelay import CniRelay, UnsafeSocket

pytestmark = pytest.mark.integration

PLUGIN = shutil.which("flagella-cni", path=str(Path(sys.executable).parent)) or "flagella-cni"
NOBODY = 65534
ADD_ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/proc/self/ns/net",
    "CNI_IFNAME": "eth0",
}


def run_plugin(
    env: dict[str, str],
    conf: dict[str, object] | bytes,
    socket: str = "",
    uid: int | None = None,
) -> tuple[int, dict[str, object]]:
    """The plugin's exit status and output; `socket` goes into the config
    (the node's socket). With `uid`, it runs as that user instead, on the
    system's Python (the venv's may be out of that user's reach: the plugin
    needs only the standard library)."""
    if socket and isinstance(conf, dict):
        conf = {**conf, "socket": socket}
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    command, extra = [PLUGIN], {}
    if uid is not None:
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                   "/usr/bin/python3", "-s", "-m", "flagella.cni"]  # fmt: skip
        extra = {"PYTHONPATH": str(Path(flagella.cni.__file__).parents[2])}
    proc = subprocess.run(
        command,
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
        env={"PATH": os.environ.get("PATH", ""), **env, **extra},
    )
    out = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, out


@pytest.fixture
def endpoint_service(etcd: EtcdServer, spawn: Callable[..., ServiceProcess]) -> ServiceProcess:
    """The endpoint service (ipam and policy are not needed for what these
    tests ask: they never get past validation, or ask for STATUS)."""
    return spawn(
        "endpoint",
        "--etcd-endpoints", etcd.endpoint,
        "--ipam-address", f"127.0.0.1:{free_port()}",
        "--policy-address", f"127.0.0.1:{free_port()}",
    )  # fmt: skip


@pytest.fixture
def node_socket(endpoint_service: ServiceProcess) -> Iterator[str]:
    with node_relay(endpoint_service.address, "n1") as path:
        yield path


def test_version() -> None:
    rc, out = run_plugin({"CNI_COMMAND": "VERSION"}, {"cniVersion": "1.1.0"})
    assert rc == 0
    assert out["cniVersion"] == "1.1.0"
    assert set(out["supportedVersions"]) >= {"0.4.0", "1.0.0", "1.1.0"}  # type: ignore[arg-type]


def test_endpoint_service_down_is_try_again_later() -> None:
    conf = {"cniVersion": "1.0.0", "name": "n", "type": "flagella-cni", "timeout": 5}
    env = ADD_ENV
    with node_relay(f"127.0.0.1:{free_port()}", "n1") as path:
        rc, out = run_plugin(env, conf, path)
        assert rc != 0
        assert out["code"] == 11
        assert out["cniVersion"] == "1.0.0"
        assert "try again later" in str(out["msg"])
        assert "endpoint service at 127.0.0.1:" in str(out["msg"])
        rc, out = run_plugin({**env, "CNI_COMMAND": "DEL"}, conf, path)
        assert rc != 0
        assert out["code"] == 11


def test_bad_input_gets_spec_error_objects(node_socket: str) -> None:
    rc, out = run_plugin(
        {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"},
        {"cniVersion": "1.1.0", "name": "n", "type": "flagella-cni"},
        node_socket,
    )
    assert rc != 0
    assert out["code"] == 4
    assert out["msg"] == "CNI_NETNS not set (required for ADD)"
    rc, out = run_plugin({"CNI_COMMAND": "ADD"}, b"{{{", node_socket)
    assert (rc != 0, out["code"]) == (True, 6)
    rc, out = run_plugin(
        {"CNI_COMMAND": "ADD"}, {"cniVersion": "0.1.0", "name": "n", "type": "t"}, node_socket
    )
    assert (rc != 0, out["code"]) == (True, 1)


def test_no_socket_is_try_again_later_naming_it(tmp_path: Path) -> None:
    conf = {"cniVersion": "1.0.0", "name": "n", "type": "flagella-cni"}
    missing = str(tmp_path / "cni.sock")
    rc, out = run_plugin(ADD_ENV, conf, missing)
    assert (rc, out["code"], out["cniVersion"]) == (1, 11, "1.0.0")
    assert f"no flagella datapath serves {missing}" in str(out["msg"])
    # Something there, nothing listening: the same.
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(missing)
        rc, out = run_plugin(ADD_ENV, conf, missing)
    assert (rc, out["code"]) == (1, 11)
    # STATUS: flagella is not available on this node.
    rc, out = run_plugin({"CNI_COMMAND": "STATUS"}, {**conf, "cniVersion": "1.1.0"}, missing)
    assert (rc, out["code"]) == (1, 50)


def test_the_plugin_has_no_address_and_no_node_of_its_own(node_socket: str) -> None:
    """The node is the relaying datapath's; an endpoint address or a node in
    the config is refused, naming the field."""
    base = {"cniVersion": "1.1.0", "name": "n", "type": "flagella-cni"}
    for field, value in (("endpoint", "10.96.0.53:50053"), ("node", "node-b")):
        rc, out = run_plugin(ADD_ENV, {**base, field: value}, node_socket)
        assert (rc, out["code"]) == (1, 7), out
        assert str(out["msg"]).startswith(f"network config: {field} is not used any more")


def test_status_relayed_names_what_is_not_ready(node_socket: str) -> None:
    # ipam and policy are not running: the endpoint service says so.
    conf = {"cniVersion": "1.1.0", "name": "n", "type": "flagella-cni"}
    rc, out = run_plugin({"CNI_COMMAND": "STATUS"}, conf, node_socket)
    assert (rc, out["code"], out["msg"]) == (1, 50, "flagella is not ready")
    assert "ipam: " in str(out["details"])
    assert "policy: " in str(out["details"])


def test_the_socket_is_root_only(require_root: None, node_socket: str) -> None:
    info = os.stat(node_socket)
    assert stat.S_ISSOCK(info.st_mode)
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o600, 0)
    conf = {"cniVersion": "1.1.0", "name": "n", "type": "flagella-cni"}
    # nobody may reach the socket's folder but not open the socket.
    os.chmod(os.path.dirname(node_socket), 0o755)
    rc, out = run_plugin({"CNI_COMMAND": "STATUS"}, conf, node_socket, uid=NOBODY)
    assert (rc, out["code"]) == (1, 5), out
    assert "only root may" in str(out["msg"])
    # Should the mode ever be widened, the relay still refuses any uid but root.
    os.chmod(node_socket, 0o666)
    rc, out = run_plugin({"CNI_COMMAND": "STATUS"}, conf, node_socket, uid=NOBODY)
    assert (rc, out["code"]) == (1, 100), out
    assert f"may not use {node_socket}" in str(out["msg"])


def test_the_relay_refuses_a_folder_others_may_write(tmp_path: Path) -> None:
    """Anyone who may write the socket's folder could swap the socket: the
    datapath refuses to serve there (and exits naming the folder)."""
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)

    async def open_relay() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
            relay = CniRelay(str(folder / "cni.sock"), "n1", "endpoint", channel)
            with pytest.raises(UnsafeSocket, match="writable by it alone"):
                await relay.open()

    asyncio.run(open_relay())
    assert not (folder / "cni.sock").exists()
