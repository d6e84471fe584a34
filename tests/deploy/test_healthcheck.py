"""The container health probe (docker/healthcheck.py, flagella-healthcheck in
the images) against a real grpc.aio server with the standard health service:
its minimal HTTP/2 client must read every status the way grpc clients do."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from harness.net import free_port

from flagella.common import pki

PROBE = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"


def load_probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("flagella_healthcheck", PROBE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = load_probe()


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, health.aio.HealthServicer]]:
    srv = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}", servicer
    await srv.stop(0)


async def run_probe(
    *args: str, env: dict[str, str] | None = None, insecure: bool = True
) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-S",  # as lean as in the image: the standard library only
        str(PROBE),
        *(["--insecure"] if insecure else []),
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env or {},
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode().strip()


async def test_serving_not_serving_and_unknown_service(
    server: tuple[str, health.aio.HealthServicer],
) -> None:
    address, servicer = server
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await servicer.set("flagella.ipam.v1.IpamService", health_pb2.HealthCheckResponse.NOT_SERVING)

    assert await run_probe(address) == (0, f"{address}: SERVING")
    code, out = await run_probe(address, "--service", "flagella.ipam.v1.IpamService")
    assert (code, out) == (1, f"{address}: NOT_SERVING")
    code, out = await run_probe(address, "--service", "no.such.Service")
    assert code == 1
    assert "no response message" in out

    await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert (await run_probe(address))[0] == 1
    # The probe's status matches what a grpc client reads.
    async with grpc.aio.insecure_channel(address) as ch:
        stub: Any = health_pb2_grpc.HealthStub(ch)  # its type stubs lack Check
        resp = await stub.Check(health_pb2.HealthCheckRequest())
    assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_address_from_the_service_listen_variable(
    server: tuple[str, health.aio.HealthServicer],
) -> None:
    address, servicer = server
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = address.rsplit(":", 1)[1]
    code, out = await run_probe(env={"FLAGELLA_LB_LISTEN": f"0.0.0.0:{port}"})
    assert (code, out) == (0, f"127.0.0.1:{port}: SERVING")


async def test_nothing_listening_is_unhealthy() -> None:
    code, out = await run_probe(f"127.0.0.1:{free_port()}")
    assert code == 1
    assert "refused" in out.lower()


def test_listen_address_mapping() -> None:
    assert probe.listen_address({"FLAGELLA_IPAM_LISTEN": "0.0.0.0:50051"}) == "127.0.0.1:50051"
    assert probe.listen_address({"FLAGELLA_IPAM_LISTEN": "[::]:50051"}) == "[::1]:50051"
    assert probe.listen_address({"FLAGELLA_X_LISTEN": "10.0.0.1:1"}) == "10.0.0.1:1"
    assert probe.listen_address({"FLAGELLA_X_LISTEN": "unix:/run/x.sock"}) == "unix:/run/x.sock"
    with pytest.raises(probe.ProbeError):
        probe.listen_address({})
    # The service's other addresses are not its gRPC one.
    both = {"FLAGELLA_X_LISTEN": "10.0.0.1:1", "FLAGELLA_X_METRICS_LISTEN": "10.0.0.1:9965"}
    assert probe.listen_address(both) == "10.0.0.1:1"


def test_hpack_integers() -> None:
    """RFC 7541 C.1: 10 and 1337 with a 5-bit prefix."""
    assert probe.hpack_int(10, 5, 0) == bytes([0b01010])
    assert probe.hpack_int(1337, 5, 0) == bytes([0b11111, 0b10011010, 0b00001010])


async def test_a_service_with_mutual_tls_is_probed_with_its_certificate(tmp_path: Path) -> None:
    """The probe presents the service's certificate from the service's own
    settings (FLAGELLA_<SVC>_TLS_*), over TLS with ALPN h2."""
    ca = pki.CertificateAuthority.create()
    lb = ca.issue(pki.service("lb"), dns=["localhost"], ips=["127.0.0.1"])
    pki.write_bundle(tmp_path, lb, ca.cert_pem)
    srv = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    creds = grpc.ssl_server_credentials(
        [(lb.key, lb.cert)], root_certificates=ca.cert_pem, require_client_auth=True
    )
    port = srv.add_secure_port("127.0.0.1:0", creds)
    await srv.start()
    try:
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        env = {
            "FLAGELLA_LB_LISTEN": f"0.0.0.0:{port}",
            "FLAGELLA_LB_TLS_CERT": str(tmp_path / "tls.crt"),
            "FLAGELLA_LB_TLS_KEY": str(tmp_path / "tls.key"),
            "FLAGELLA_TLS_CA": str(tmp_path / "ca.crt"),
        }
        assert await run_probe(env=env, insecure=False) == (0, f"127.0.0.1:{port}: SERVING")
        # Plaintext against a TLS port: unhealthy, not a hang.
        code, _ = await run_probe(f"127.0.0.1:{port}")
        assert code == 1
        # No certificate files: unhealthy, naming the problem.
        code, out = await run_probe(f"127.0.0.1:{port}", env={}, insecure=False)
        assert code == 1
        assert "No such file" in out
    finally:
        await srv.stop(0)
