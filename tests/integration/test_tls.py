"""Certificates through real processes: rotation without dropping streams,
expiry, start-up errors, the plaintext health port, the --insecure switch
and `flagella certs`."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import tls
from harness.etcd import EtcdServer
from harness.net import free_port
from harness.procs import SERVING, ServiceProcess, health_status

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.common import pki
from flagella.common import tls as common_tls

pytestmark = pytest.mark.integration

CLI = str(Path(sys.executable).parent / "flagella")


def serial_of(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def served_certificate(port: int, client: Path) -> bytes:
    """The certificate a TLS handshake with 127.0.0.1:port is answered with."""
    ctx = ssl.create_default_context(cafile=str(client / "ca.crt"))
    ctx.load_cert_chain(str(client / "tls.crt"), str(client / "tls.key"))
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


async def test_rotation_keeps_streams_and_new_calls_present_the_new_certificate(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    session = tls.session()
    server_dir, client_dir = tmp_path / "ipam-tls", tmp_path / "client-tls"
    pki.write_bundle(server_dir, session.issue(pki.service("ipam")), session.ca.cert_pem)
    pki.write_bundle(client_dir, session.issue(pki.operator("before")), session.ca.cert_pem)
    ipam = spawn(
        "ipam",
        "--etcd-endpoints", etcd.endpoint,
        "--cluster-cidr", "10.244.0.0/16",
        "--tls-cert", str(server_dir / "tls.crt"),
        "--tls-key", str(server_dir / "tls.key"),
        "--tls-ca", str(server_dir / "ca.crt"),
    )  # fmt: skip
    # What every service's runtime.channel() is: a reloading channel.
    files = common_tls.TlsFiles(common_tls.TlsPaths.in_dir(client_dir), check_interval=0.1)
    channel = common_tls.secure_channel(ipam.address, files)
    stub = ipam_pb2_grpc.IpamServiceStub(channel)

    async def caller_seen() -> str:
        """The identity ipam saw on a new call (it names it when denying)."""
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterNode(ipam_pb2.RegisterNodeRequest(name="x"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        return str(err.value.details()).split(" may not call ")[0]

    stream = stub.WatchNodes(ipam_pb2.WatchNodesRequest())
    while (await stream.read()).kind != ipam_pb2.NodeEvent.KIND_SYNCED:
        pass
    assert await caller_seen() == "spiffe://flagella/operator/before"
    first_served = served_certificate(ipam.port, session.bundle(tls.OPERATOR))

    # Both sides' files are replaced (as a Secret update or cert-manager does).
    new_server = session.issue(pki.service("ipam"))
    pki.write_bundle(server_dir, new_server, session.ca.cert_pem, overwrite=True)
    pki.write_bundle(
        client_dir, session.issue(pki.operator("after")), session.ca.cert_pem, overwrite=True
    )
    await asyncio.sleep(1.2)  # past both sides' check interval

    assert await caller_seen() == "spiffe://flagella/operator/after"
    served = served_certificate(ipam.port, session.bundle(tls.OPERATOR))
    assert serial_of(served) == serial_of(new_server.cert) != serial_of(first_served)

    # The stream opened with the old certificates goes on.
    with ipam.channel(pki.node("rotated-node")) as ch:
        ipam_pb2_grpc.IpamServiceStub(ch).RegisterNode(
            ipam_pb2.RegisterNodeRequest(name="rotated-node", datapath_address="127.0.0.1:1"),
            timeout=10,
        )
    event = await asyncio.wait_for(stream.read(), 10)
    assert event.kind == ipam_pb2.NodeEvent.KIND_UPSERT
    assert event.node.name == "rotated-node"
    # The old connection is closed once its last call (the stream) is done.
    assert channel.open_channels == 2
    stream.cancel()
    await asyncio.sleep(0.1)
    assert channel.open_channels == 1
    await channel.close()
    assert "certificate files reloaded" in ipam.logs()


async def test_an_expired_client_certificate_is_refused(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    session = tls.session()
    short = session.ca.issue(pki.operator("brief"), lifetime=dt.timedelta(seconds=3))
    not_after = x509.load_pem_x509_certificate(short.cert).not_valid_after_utc
    creds = grpc.ssl_channel_credentials(session.ca.cert_pem, short.key, short.cert)
    request = lb_pb2.ListServicesRequest()
    async with grpc.aio.secure_channel(lb.address, creds) as ch:
        stub = lb_pb2_grpc.LoadBalancerServiceStub(ch)
        await stub.ListServices(request, timeout=10)
        await asyncio.sleep((not_after - pki.now()).total_seconds() + 0.5)
        # The connection made while it was valid is still open: refused per call.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListServices(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "expired" in str(err.value.details())
    # A new connection with it fails the handshake.
    async with grpc.aio.secure_channel(lb.address, creds) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await lb_pb2_grpc.LoadBalancerServiceStub(ch).ListServices(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def bad_files(tmp: Path) -> dict[str, tuple[list[str], str, str]]:
    """case -> (flags, option, the end of the one line)."""
    session = tls.session()
    good = session.bundle(pki.service("lb"))
    cert, key, ca = (str(good / n) for n in ("tls.crt", "tls.key", "ca.crt"))
    expired = session.ca.issue(
        pki.service("lb"),
        not_before=pki.now() - dt.timedelta(hours=2),
        lifetime=dt.timedelta(hours=1),
    )
    pki.write_bundle(tmp / "expired", expired, session.ca.cert_pem)
    other = tls.TestPki(tmp / "other")
    other_lb = other.bundle(pki.service("lb"))
    (tmp / "garbage.pem").write_text("not a certificate\n")
    return {
        "missing cert": (["--tls-cert", str(tmp / "nope.crt")], "--tls-cert", "no such file"),
        "expired cert": (
            ["--tls-cert", str(tmp / "expired/tls.crt"), "--tls-key", str(tmp / "expired/tls.key")],
            "--tls-cert",
            "expired on",
        ),
        "unreadable key": (["--tls-key", str(tmp)], "--tls-key", "cannot read: Is a directory"),
        "key of another cert": (
            ["--tls-key", str(session.bundle(tls.OPERATOR) / "tls.key")],
            "--tls-key",
            f"does not match the certificate in {cert}",
        ),
        "not PEM": (["--tls-ca", str(tmp / "garbage.pem")], "--tls-ca", "not a PEM certificate"),
        "another CA": (
            ["--tls-ca", str(other_lb / "ca.crt")],
            "--tls-cert",
            f"not issued by the CA in {other_lb / 'ca.crt'}",
        ),
        "another identity": (
            ["--tls-cert", str(session.bundle(pki.service("ipam")) / "tls.crt"),
             "--tls-key", str(session.bundle(pki.service("ipam")) / "tls.key")],
            "--tls-cert",
            "names spiffe://flagella/service/ipam, but this process is spiffe://flagella/service/lb",
        ),
        "_good": ([cert, key, ca], "", ""),
    }  # fmt: skip


def test_bad_certificate_files_exit_2_naming_the_file(tmp_path: Path) -> None:
    cases = bad_files(tmp_path)
    good = cases.pop("_good")[0]
    for case, (flags, option, problem) in cases.items():
        proc = subprocess.run(
            [sys.executable, "-m", "flagella.lb", "--tls-cert", good[0], "--tls-key", good[1],
             "--tls-ca", good[2], *flags],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert proc.returncode == 2, (case, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (case, lines)
        assert lines[0].startswith(f"flagella-lb: error: invalid {option}: "), (case, lines)
        assert lines[0].endswith(problem) or problem in lines[0], (case, lines)


def test_the_health_port_is_plaintext_and_serves_health_alone(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    health = f"127.0.0.1:{free_port()}"
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--health-listen", health)
    assert health_status(health) == SERVING
    assert health_status(health, "flagella.liveness") == SERVING
    with grpc.insecure_channel(health) as ch:
        with pytest.raises(grpc.RpcError) as err:
            lb_pb2_grpc.LoadBalancerServiceStub(ch).ListServices(
                lb_pb2.ListServicesRequest(), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The service's own port wants a certificate, for health too.
    assert health_status(lb.address) is None
    assert lb.health() == SERVING


def test_insecure_is_plaintext_and_says_so(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, insecure=True)
    with grpc.insecure_channel(lb.address) as ch:
        stub: Any = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
        # No authorization either: anyone may write.
        lb_pb2_grpc.LoadBalancerServiceStub(ch).ListServices(
            lb_pb2.ListServicesRequest(), timeout=5
        )
    warnings = [
        json.loads(line)
        for line in lb.logs().splitlines()
        if line.startswith("{") and "INSECURE" in line
    ]
    assert warnings
    assert warnings[0]["level"] == "warning"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=30, check=False)


def test_flagella_certs_issues_and_refuses_to_overwrite(tmp_path: Path) -> None:
    def certs(*args: str) -> subprocess.CompletedProcess[str]:
        return cli("certs", *args)

    ca = tmp_path / "ca"
    assert certs("ca", "--out", str(ca)).returncode == 0
    again = certs("ca", "--out", str(ca))
    assert again.returncode == 1
    assert again.stderr.strip() == f"flagella: {ca / 'ca.crt'} exists (--force replaces it)"
    assert certs("ca", "--out", str(ca), "--force").returncode == 0
    assert oct((ca / "ca.key").stat().st_mode & 0o777) == "0o600"

    node = tmp_path / "node"
    made = certs("node", "worker-1", "--ca", str(ca), "--out", str(node), "--ip", "10.0.0.7")
    assert made.returncode == 0, made.stderr
    material = pki.load_material(node / "tls.crt", node / "tls.key", node / "ca.crt")
    assert material.identity == pki.node("worker-1")
    lifetime = material.not_after - pki.now()
    assert dt.timedelta(hours=23) < lifetime <= dt.timedelta(hours=24)
    cert = x509.load_pem_x509_certificate(material.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "worker-1" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == [
        "127.0.0.1",
        "::1",
        "10.0.0.7",
    ]
    assert oct((node / "tls.key").stat().st_mode & 0o777) == "0o600"

    bad = certs("service", "Not_A_Label", "--ca", str(ca), "--out", str(tmp_path / "x"))
    assert bad.returncode == 1
    assert "invalid service name 'Not_A_Label'" in bad.stderr
    assert not (tmp_path / "x").exists()
    shutil.rmtree(ca)
    missing = certs("operator", "alice", "--ca", str(ca), "--out", str(tmp_path / "op"))
    assert missing.returncode == 1
    assert f"cannot read the CA in {ca}" in missing.stderr


def test_the_cli_without_its_certificate_says_how_to_get_one(tmp_path: Path) -> None:
    proc = cli("--tls-dir", str(tmp_path / "none"), "service", "list")
    assert proc.returncode == 1
    assert "operator certificate" in proc.stderr
    assert "flagella certs operator" in proc.stderr
