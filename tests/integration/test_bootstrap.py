"""Every service starts on the shared bootstrap, reports SERVING, and is
reachable with the real grpcurl through server reflection."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from harness import tls
from harness.etcd import EtcdServer
from harness.lb import LbClient
from harness.net import free_port
from harness.procs import SERVING, ServiceProcess

from flagella.api.lb.v1 import lb_pb2

pytestmark = pytest.mark.integration

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or "grpcurl"

SERVICES = {
    "ipam": "flagella.ipam.v1.IpamService",
    "policy": "flagella.policy.v1.PolicyService",
    "endpoint": "flagella.endpoint.v1.EndpointService",
    "lb": "flagella.lb.v1.LoadBalancerService",
    "datapath": "flagella.datapath.v1.DatapathService",
}


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    """grpcurl as an operator (mutual TLS with the session CA)."""
    folder = tls.session().bundle(tls.OPERATOR)
    certs = [
        "-cacert",
        f"{folder}/ca.crt",
        "-cert",
        f"{folder}/tls.crt",
        "-key",
        f"{folder}/tls.key",
    ]
    return subprocess.run(
        [GRPCURL, *certs, *args], capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture
def suite(etcd: EtcdServer, spawn: Callable[..., ServiceProcess]) -> dict[str, ServiceProcess]:
    """The five services, each on its own port, sharing one etcd."""
    return {svc: spawn(svc, *suite_args(svc, etcd)) for svc in SERVICES}


def suite_args(svc: str, etcd: EtcdServer) -> list[str]:
    if svc == "datapath":
        return []
    return ["--etcd-endpoints", etcd.endpoint]


def test_grpcurl_lists_describes_and_health_checks_every_service(
    suite: dict[str, ServiceProcess],
) -> None:
    for svc, full_name in SERVICES.items():
        address = suite[svc].address
        listed = grpcurl(address, "list")
        assert listed.returncode == 0, listed.stderr
        names = listed.stdout.split()
        assert full_name in names
        assert "grpc.health.v1.Health" in names
        # Only this service's flagella API on its port.
        assert [n for n in names if n.startswith("flagella.")] == [full_name]

        described = grpcurl(address, "describe", full_name)
        assert described.returncode == 0, described.stderr
        assert f"service {full_name.rsplit('.', 1)[1]} {{" in described.stdout
        assert "rpc " in described.stdout

        health = grpcurl(address, "grpc.health.v1.Health/Check")
        assert health.returncode == 0, health.stderr
        assert json.loads(health.stdout) == {"status": "SERVING"}
        per_service = grpcurl(
            "-d", json.dumps({"service": full_name}), address, "grpc.health.v1.Health/Check"
        )
        assert json.loads(per_service.stdout) == {"status": "SERVING"}


def test_describe_shows_message_fields(suite: dict[str, ServiceProcess]) -> None:
    out = grpcurl(suite["ipam"].address, "describe", "flagella.ipam.v1.AllocateRequest")
    assert out.returncode == 0, out.stderr
    for field in (
        "string node = 1;",
        ".flagella.ipam.v1.Owner owner = 2;",
        "repeated .flagella.ipam.v1.Family families = 3;",
    ):
        assert field in out.stdout


def test_unknown_flag_exits_2_with_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flagella.policy", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "flagella-policy: error: invalid arguments: unrecognized arguments: --no-such-flag"
    ]


@pytest.mark.parametrize(
    ("svc", "args", "reason"),
    [
        (
            "ipam",
            ["--cluster-cidr", "10.0.0/8"],
            "invalid --cluster-cidr: '10.0.0/8' is not a valid CIDR",
        ),
        (
            "ipam",
            ["--cluster-cidr", "10.0.0.1/8"],
            "invalid --cluster-cidr: '10.0.0.1/8' is not a valid CIDR",
        ),
        (
            "lb",
            ["--listen", "127.0.0.1:99999"],
            "invalid --listen: '127.0.0.1:99999' has no valid port",
        ),
        (
            "endpoint",
            ["--etcd-endpoints", "nohost"],
            "invalid --etcd-endpoints: 'nohost' is not host:port",
        ),
    ],
)
def test_bad_config_exits_2_naming_the_option(svc: str, args: list[str], reason: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"flagella.{svc}", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"flagella-{svc}: error: {reason}")


def test_bad_config_from_environment_names_the_variable() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flagella.ipam"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "FLAGELLA_IPAM_NODE_MASK_SIZE_V4": "abc"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(
        "flagella-ipam: error: invalid FLAGELLA_IPAM_NODE_MASK_SIZE_V4:"
    )


def test_unreachable_etcd_is_not_serving_until_etcd_appears(
    tmp_path: Path, spawn: Callable[..., ServiceProcess]
) -> None:
    etcd = EtcdServer(tmp_path / "late-etcd")
    try:
        proc = spawn("policy", "--etcd-endpoints", etcd.endpoint, wait=False)
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline and status is None:
            status = proc.health()
            time.sleep(0.1)
        assert status is not None, proc.logs()
        assert status != SERVING
        time.sleep(1.0)
        assert proc.health() != SERVING
        # Alive all along: a liveness probe would not restart it.
        assert proc.health("flagella.liveness") == SERVING
        etcd.start()
        proc.wait_serving(timeout=20)
        # etcd going away flips it back to NOT_SERVING, and back again.
        etcd.stop()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.health() == SERVING:
            time.sleep(0.1)
        assert proc.health() not in (SERVING, None)
        etcd.start()
        proc.wait_serving(timeout=20)
    finally:
        etcd.cleanup()


def test_sigterm_reports_not_serving_then_exits_cleanly(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    proc = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--shutdown-grace", "1")
    proc.signal(15)
    assert proc.proc is not None
    assert proc.proc.wait(15) == 0
    logs = [json.loads(line) for line in proc.logs().splitlines() if line.startswith("{")]
    messages = [entry["msg"] for entry in logs]
    assert messages.index("stopping") < messages.index("stopped")
    assert all(entry["service"] == "flagella-lb" for entry in logs)


@pytest.mark.insecure
def test_sigterm_ends_open_streams_at_once_with_unavailable(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    # A watch never ends by itself: it must not hold the whole shutdown
    # grace (30 s here), and its client is told to go elsewhere.
    proc = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--shutdown-grace", "30")
    client = LbClient(proc.address)
    stream = client.watch(timeout=60)
    assert next(stream).kind == lb_pb2.ServiceEvent.KIND_RESET
    started = time.monotonic()
    proc.signal(15)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert proc.proc is not None
    assert proc.proc.wait(15) == 0
    assert time.monotonic() - started < 5
    client.close()


def test_listen_on_a_port_in_use_fails_with_reason(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    first = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    port = first.port
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flagella.lb",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd-endpoints",
            etcd.endpoint,
            *first.tls_args(),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr.strip().splitlines()[-1]
    assert free_port() != port
