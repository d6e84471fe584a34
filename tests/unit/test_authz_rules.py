"""The authorization table's logic and identities (pure; the services
enforce it in tests/integration/test_authz.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.common import authz, pki, tls
from flagella.common.authz import Authorizer, Denied
from flagella.common.config import ServiceConfig, load_config
from flagella.common.errors import ConfigError
from flagella.datapath.config import DatapathConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "SECURITY.md"
NODE_A = pki.node("node-a")


def test_security_md_prints_the_table_from_the_code() -> None:
    assert authz.markdown() in DOCS.read_text(), "run python -m flagella.common.authz"


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("spiffe://other/service/ipam", "is not a spiffe://flagella/ identity"),
        ("spiffe://flagella/service", "has no <kind>/<name>"),
        ("spiffe://flagella/robot/x", "unknown identity kind 'robot'"),
        ("spiffe://flagella/service/IPAM", "invalid service name 'IPAM'"),
        ("spiffe://flagella/node/-a", "invalid node name '-a'"),
        ("spiffe://flagella/operator/a/b", "invalid operator name 'a/b'"),
    ],
)
def test_identities_are_validated(uri: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        pki.Identity.parse(uri)


def test_identity_round_trip() -> None:
    assert pki.Identity.parse("spiffe://flagella/node/worker-1.example") == pki.node(
        "worker-1.example"
    )
    assert pki.service("ipam").uri == "spiffe://flagella/service/ipam"


async def test_scoping_by_request_field() -> None:
    a = Authorizer()
    method = "/flagella.ipam.v1.IpamService/RegisterNode"
    await a.check(method, NODE_A, ipam_pb2.RegisterNodeRequest(name="node-a"))
    with pytest.raises(Denied, match="name 'node-b' is not the caller's node"):
        await a.check(method, NODE_A, ipam_pb2.RegisterNodeRequest(name="node-b"))
    with pytest.raises(Denied, match="not allowed for this identity"):
        await a.check(method, pki.operator("x"), ipam_pb2.RegisterNodeRequest(name="node-a"))


async def test_scoping_by_resource_needs_its_resolver() -> None:
    method = "/flagella.endpoint.v1.EndpointService/DeleteEndpoint"
    request = endpoint_pb2.DeleteEndpointRequest(id=5)
    with pytest.raises(Denied, match="cannot tell which node the endpoint is on"):
        await Authorizer().check(method, NODE_A, request)

    owners = {5: "node-b", 6: "node-a"}

    async def node_of(req: Any) -> str | None:
        return owners.get(req.id)

    a = Authorizer(resolvers={"endpoint": node_of})
    with pytest.raises(Denied, match="the endpoint is on node 'node-b'"):
        await a.check(method, NODE_A, request)
    await a.check(method, NODE_A, endpoint_pb2.DeleteEndpointRequest(id=6))
    await a.check(method, NODE_A, endpoint_pb2.DeleteEndpointRequest(id=7))  # no such endpoint


async def test_a_method_without_an_entry_is_denied() -> None:
    with pytest.raises(Denied, match="no authorization entry"):
        await Authorizer().check("/flagella.x.v1.X/New", pki.operator("root"), None)


def test_peer_identity_checks_expiry_and_presence() -> None:
    ca = pki.CertificateAuthority.create()
    issued = ca.issue(pki.operator("o"), lifetime=dt.timedelta(hours=1))
    ctx = {"x509_pem_cert": [issued.cert]}
    assert tls.peer_identity(ctx, pki.now()) == pki.operator("o")
    with pytest.raises(tls.Unauthenticated, match="expired"):
        tls.peer_identity(ctx, pki.now() + dt.timedelta(hours=2))
    with pytest.raises(tls.Unauthenticated, match="no client certificate"):
        tls.peer_identity({}, pki.now())


def test_reloading_files_keeps_the_old_ones_while_new_ones_are_unusable(tmp_path: Path) -> None:
    ca = pki.CertificateAuthority.create()
    pki.write_bundle(tmp_path, ca.issue(pki.service("lb")), ca.cert_pem)
    now = [0.0]
    files = tls.TlsFiles(tls.TlsPaths.in_dir(tmp_path), check_interval=1.0, clock=lambda: now[0])
    first = files.current
    # A new certificate whose key is not there yet: half way through a copy.
    second = ca.issue(pki.service("lb"))
    pki.write_files(tmp_path, {"tls.crt": second.cert}, overwrite=True)
    now[0] = 2.0
    assert files.latest() is first
    pki.write_files(tmp_path, {"tls.key": second.key}, overwrite=True)
    now[0] = 2.5  # within the check interval: not looked at
    assert files.latest() is first
    now[0] = 4.0
    assert files.latest().cert == second.cert


def test_a_process_knows_the_identity_its_certificate_must_name() -> None:
    def load(cls: type[ServiceConfig], *argv: str) -> ServiceConfig:
        return load_config(cls, prog="t", env_prefix="T_", argv=argv, environ={})

    assert load(ServiceConfig).tls_identity("lb") == pki.service("lb")
    assert load(DatapathConfig, "--node-name", "n-1").tls_identity("datapath") == pki.node("n-1")
    with pytest.raises(ConfigError, match="invalid --node-name: invalid node name 'a/b'"):
        load(DatapathConfig, "--node-name", "a/b")
