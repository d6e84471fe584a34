"""Least-privilege etcd, on a real etcd with TLS, --client-cert-auth and
authentication on (the harness's default etcd): each service's etcd user
reaches its own keys and nothing else, as the table written HERE says
(independently of flagella.common.etcdauth); a client without a certificate
from the etcd CA gets nowhere; the services run as their users; and
`flagella etcd-auth apply` sets etcd up, idempotently."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from aetcd import rpc as etcd_rpc
from cryptography import x509
from cryptography.x509.oid import NameOID
from harness import tls
from harness.etcd import EtcdServer, session_pki
from harness.lb import service
from harness.procs import ServiceProcess
from harness.suite import control_plane

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common import etcdauth, pki
from flagella.common.errors import Unavailable
from flagella.common.etcd import Etcd
from flagella.common.tls import TlsFiles, TlsPaths

pytestmark = pytest.mark.integration

# One key in each area of flagella's etcd layout, and two outside it.
KEYS = {
    "ipam": "flagella/ipam/v1/nodes/n1",
    "endpoint": "flagella/endpoint/v1/endpoints/x",
    "lb": "flagella/lb/v1/services/default/web",
    "rules": "flagella/policy/v1/rules/default/r",
    "identities": "flagella/state/identities/v1/id/256",
    "ipcache": "flagella/state/ip/v1/10.0.0.1",
    "other": "flagella/other/v1/x",
    "outside": "registry/secrets/x",
}
# Who may write (and so read) each area.
WRITES = {
    "ipam": {"ipam"},
    "endpoint": {"endpoint"},
    "lb": {"lb"},
    "policy": {"rules", "identities", "ipcache"},
}


def denied(exc: BaseException) -> bool:
    return isinstance(exc, Unavailable) and "PERMISSION_DENIED" in exc.message


async def outcome(op: Callable[[], Awaitable[object]]) -> str:
    """allowed, denied (PERMISSION_DENIED), or what else went wrong."""
    try:
        await op()
    except Unavailable as exc:
        return "denied" if denied(exc) else exc.message
    return "allowed"


@pytest.mark.parametrize("svc", sorted(WRITES))
async def test_each_service_reaches_its_own_keys_only(etcd: EtcdServer, svc: str) -> None:
    root = etcd.client()
    client = etcd.client(svc)
    try:
        for key in KEYS.values():
            await root.put(key, b"root")
        got: dict[str, tuple[str, str, str, str]] = {}
        for area, key in KEYS.items():
            got[area] = (
                await outcome(lambda k=key: client.get(k)),
                await outcome(lambda k=key: client.get_prefix(k.rsplit("/", 1)[0] + "/")),
                await outcome(lambda k=key: client.put(k, svc.encode())),
                await outcome(lambda k=key: client.delete(k)),
            )
        yes = ("allowed",) * 4
        no = ("denied",) * 4
        assert got == {area: yes if area in WRITES[svc] else no for area in KEYS}
        # Every user reads the current revision (a linearizable read).
        assert await client.current_revision() > 0
    finally:
        await client.close()
        await root.close()


async def test_the_policy_mirror_watches_its_one_range_and_no_wider(etcd: EtcdServer) -> None:
    root = etcd.client()
    policy = etcd.client("policy")
    ipam = etcd.client("ipam")
    try:
        rev = await root.put(KEYS["identities"], b"{}")
        end = b"flagella/state/ip/v10"
        async with policy.watch_keys("flagella/policy/v1/cidrgroups/", end, rev) as watch:
            batch = await asyncio.wait_for(anext(aiter(watch)), 10)
        assert [e.kv.key for e in batch.events] == [KEYS["identities"]]
        # One byte past the range: refused (etcd cancels the watch).
        with pytest.raises(Unavailable, match="permission denied"):
            async with policy.watch_keys(
                "flagella/policy/v1/cidrgroups/", end + b"\0", rev
            ) as watch:
                await asyncio.wait_for(anext(aiter(watch)), 10)
        with pytest.raises(Unavailable, match="permission denied"):
            async with ipam.watch("flagella/state/", rev) as watch:
                await asyncio.wait_for(anext(aiter(watch)), 10)
    finally:
        for c in (root, policy, ipam):
            await c.close()


async def _range(channel: grpc.aio.Channel) -> None:
    stub = etcd_rpc.KVStub(channel)
    await stub.Range(etcd_rpc.RangeRequest(key=b"flagella/ipam/v1/"), timeout=5)


async def test_no_certificate_or_a_foreign_one_gets_nowhere(etcd: EtcdServer) -> None:
    ca = (session_pki().user_bundle("ipam") / pki.CA_FILE).read_bytes()
    cluster = tls.session().bundle(pki.service("ipam"))  # the cluster CA's, not etcd's
    attempts = {
        "plaintext": grpc.aio.insecure_channel(etcd.endpoint),
        "TLS without a certificate": grpc.aio.secure_channel(
            etcd.endpoint, grpc.ssl_channel_credentials(ca)
        ),
        "a certificate from the cluster CA": grpc.aio.secure_channel(
            etcd.endpoint,
            grpc.ssl_channel_credentials(
                ca, (cluster / pki.KEY_FILE).read_bytes(), (cluster / pki.CERT_FILE).read_bytes()
            ),
        ),
    }
    for what, channel in attempts.items():
        try:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await _range(channel)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, what
        finally:
            await channel.close()


async def test_a_certificate_naming_no_etcd_user_is_refused(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    # From the etcd CA, but its CN (flagella-datapath) is no etcd user.
    issued = session_pki().ca.issue(pki.service("datapath"), common_name="flagella-datapath")
    pki.write_bundle(tmp_path / "dp", issued, session_pki().ca.cert_pem)
    client = Etcd([etcd.endpoint], tls_files=TlsFiles(TlsPaths.in_dir(tmp_path / "dp")))
    try:
        with pytest.raises(Unavailable, match=r"user name not found|permission denied"):
            await client.get(KEYS["ipam"])
    finally:
        await client.close()


def test_the_services_run_as_their_etcd_users(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    procs = control_plane(spawn, etcd)
    ipam, policy, lb = procs["ipam"], procs["policy"], procs["lb"]
    node = pki.node("n1")
    as_endpoint = pki.service("endpoint")
    with ipam.channel(node) as ch:
        ipam_pb2_grpc.IpamServiceStub(ch).RegisterNode(
            ipam_pb2.RegisterNodeRequest(name="n1"), timeout=10
        )
    with ipam.channel(as_endpoint) as ch:
        owner = ipam_pb2.Owner(container_id="c1", ifname="eth0")
        allocations = (
            ipam_pb2_grpc.IpamServiceStub(ch)
            .Allocate(ipam_pb2.AllocateRequest(node="n1", owner=owner), timeout=10)
            .allocations
        )
        assert allocations
    with policy.channel(as_endpoint) as ch:
        labels = [policy_pb2.Label(source="k8s", key="app", value="web")]
        identity = (
            policy_pb2_grpc.PolicyServiceStub(ch)
            .AllocateIdentity(
                policy_pb2.AllocateIdentityRequest(labels=labels, node="n1"), timeout=10
            )
            .identity
        )
        assert identity.id > 0
    with lb.channel() as ch:
        created = lb_pb2_grpc.LoadBalancerServiceStub(ch).UpsertService(
            lb_pb2.UpsertServiceRequest(service=service("default/web", "10.96.0.10")), timeout=20
        )
        assert created.created

    async def stored() -> dict[str, int]:
        root = etcd.client()
        try:
            return {
                p: (await root.count_prefix(p))[0]
                for p in ("flagella/ipam/v1/", "flagella/state/identities/v1/", "flagella/lb/v1/")
            }
        finally:
            await root.close()

    assert all(asyncio.run(stored()).values())
    for proc in procs.values():
        assert proc.health() == 1  # SERVING: its etcd probe reads as its user
        assert "permission denied" not in proc.logs().lower(), proc.svc


def _run_service(svc: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"flagella.{svc}", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_missing_or_wrong_etcd_certificate_stops_the_service_with_status_2(
    tmp_path: Path,
) -> None:
    grpc_args = tls.session().args(pki.service("ipam"))
    missing = tmp_path / "nowhere" / "tls.crt"
    proc = _run_service(
        "ipam", *grpc_args, *session_pki().service_args("ipam"), "--etcd-cert", str(missing)
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"flagella-ipam: error: invalid --etcd-cert: {missing}: no such file"
    )
    # lb's etcd certificate is not ipam's.
    proc = _run_service("ipam", *grpc_args, *session_pki().service_args("lb"))
    assert proc.returncode == 2
    assert "invalid --etcd-cert:" in proc.stderr
    assert "names spiffe://flagella/service/lb, but this process is" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flagella.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_etcd_auth_apply_sets_up_etcd_idempotently(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd", apply_auth=False).start()
    try:
        root_dir = str(session_pki().user_bundle(etcdauth.ROOT))
        apply = (
            "etcd-auth",
            "apply",
            "--etcd-endpoints",
            etcd.endpoint,
            "--etcd-tls-dir",
            root_dir,
        )
        first = _cli(*apply)
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip().endswith("authentication enabled")

        async def widen_lb() -> None:
            root = etcd.client()
            try:
                await root.client.connect()
                await etcd_rpc.AuthStub(root.client.channel).RoleGrantPermission(
                    etcd_rpc.AuthRoleGrantPermissionRequest(
                        name="flagella-lb",
                        perm=etcd_rpc.Permission(
                            permType=etcd_rpc.Permission.READWRITE, key=b"flagella/ipam/v1/"
                        ),
                    )
                )
            finally:
                await root.close()

        asyncio.run(widen_lb())
        second = _cli(*apply)
        assert second.returncode == 0, second.stderr
        assert "flagella-lb: revoked b'flagella/ipam/v1/'" in second.stdout

        async def check() -> None:
            lb = etcd.client("lb")
            try:
                await lb.put("flagella/lb/v1/x", b"1")
                with pytest.raises(Unavailable, match="PERMISSION_DENIED"):
                    await lb.put("flagella/ipam/v1/x", b"1")
            finally:
                await lb.close()

        asyncio.run(check())
        no_dir = _cli(
            "etcd-auth", "apply", "--etcd-endpoints", etcd.endpoint, "--etcd-tls-dir", str(tmp_path)
        )
        assert no_dir.returncode == 1
        assert no_dir.stderr.startswith(f"flagella: root's etcd certificate: {tmp_path}/tls.crt")
    finally:
        etcd.cleanup()


def test_etcd_auth_wait_returns_once_etcd_enforces_the_roles(tmp_path: Path) -> None:
    """What a service's init container runs in Kubernetes: as the service's
    etcd user, it waits while etcd's authentication is off (when any etcd
    certificate reaches every key), and returns once it is on."""
    etcd = EtcdServer(tmp_path / "etcd", apply_auth=False).start()
    try:
        ipam_dir = str(session_pki().user_bundle("ipam"))
        wait = ["etcd-auth", "wait", "--etcd-endpoints", etcd.endpoint, "--etcd-tls-dir", ipam_dir]
        off = _cli(*wait, "--wait", "1")
        assert off.returncode == 1
        assert "etcd-auth wait: after 1 s: authentication is off" in off.stderr
        waiting = subprocess.Popen(
            [sys.executable, "-m", "flagella.cli", *wait, "--wait", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(1.5)
            assert waiting.poll() is None
            root_dir = str(session_pki().user_bundle(etcdauth.ROOT))
            applied = _cli(
                "etcd-auth", "apply", "--etcd-endpoints", etcd.endpoint, "--etcd-tls-dir", root_dir
            )
            assert applied.returncode == 0, applied.stderr
            out, err = waiting.communicate(timeout=30)
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.communicate()
        assert waiting.returncode == 0, err
        assert out.strip() == "etcd enforces authentication"
    finally:
        etcd.cleanup()


def test_flagella_certs_issues_etcd_certificates_whose_cn_is_the_user(tmp_path: Path) -> None:
    ca = tmp_path / "etcd-ca"
    assert _cli("certs", "ca", "--name", "flagella etcd CA", "--out", str(ca)).returncode == 0

    def common_name(folder: Path) -> str:
        cert = x509.load_pem_x509_certificate((folder / pki.CERT_FILE).read_bytes())
        [cn] = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return str(cn.value)

    for user, identity, cn in (
        ("ipam", pki.service("ipam"), "flagella-ipam"),
        ("root", pki.operator("etcd-root"), "root"),
    ):
        out = tmp_path / user
        made = _cli("certs", "etcd-client", user, "--ca", str(ca), "--out", str(out))
        assert made.returncode == 0, made.stderr
        material = pki.load_material(out / pki.CERT_FILE, out / pki.KEY_FILE, out / pki.CA_FILE)
        assert material.identity == identity
        assert common_name(out) == cn
    server = tmp_path / "server"
    made = _cli(
        "certs", "etcd-server", "etcd", "--ca", str(ca), "--out", str(server),
        "--dns", "etcd.flagella.svc",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert common_name(server) == "etcd"
    cert = x509.load_pem_x509_certificate((server / pki.CERT_FILE).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"etcd", "localhost", "etcd.flagella.svc"} <= set(san.get_values_for_type(x509.DNSName))
    refused = _cli(
        "certs", "etcd-client", "datapath", "--ca", str(ca), "--out", str(tmp_path / "x")
    )
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "flagella: no etcd user for 'datapath': one of ipam, policy, endpoint, lb, root"
    )
