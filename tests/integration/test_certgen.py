"""`flagella certs sync` (a folder, as compose runs it) and `flagella certs
k8s-sync` / `k8s-fetch` (Secrets through the Kubernetes API, as the certgen
Job and the datapath's node-cert containers run them), as real processes:
against the stand-in API server (harness/kube_api.py) for Kubernetes. The
first run creates the CA and every leaf, a second changes nothing, a leaf
near expiry is renewed (and only it), a new node gets its Secret and the
datapath's Role is limited to exactly the node Secrets."""

from __future__ import annotations

import base64
import datetime as dt
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from harness.kube_api import KubeListWatchServer

from flagella.common import pki

pytestmark = pytest.mark.integration

CLI = str(Path(sys.executable).parent / "flagella")
NS = "flagella"
SERVICES = ("ipam", "policy", "endpoint", "lb")
ROLE = "flagella-datapath-node-certs"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60, check=False)


def node(name: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
    }


def ips_of(cert: bytes) -> set[str]:
    san = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    return {str(ip) for ip in san.value.get_values_for_type(x509.IPAddress)}


@pytest.fixture
def kube_api() -> Iterator[KubeListWatchServer]:
    with KubeListWatchServer() as server:
        server.apply("nodes", node("worker-1", "10.0.0.11"))
        server.apply(
            "roles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": ROLE, "namespace": NS},
                "rules": [],
            },
        )
        yield server


def decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def material(tmp: Path, data: dict[str, bytes]) -> pki.TlsMaterial:
    tmp.mkdir(parents=True, exist_ok=True)
    for name in (pki.CERT_FILE, pki.KEY_FILE, pki.CA_FILE):
        (tmp / name).write_bytes(data[name])
    return pki.load_material(tmp / pki.CERT_FILE, tmp / pki.KEY_FILE, tmp / pki.CA_FILE)


def replace_leaf(server: KubeListWatchServer, name: str, issued: pki.Issued) -> None:
    """Put another certificate and key into a leaf's Secret."""
    secret = server.get("secrets", NS, name) or {}
    secret["data"].update(
        {
            "tls.crt": base64.b64encode(issued.cert).decode(),
            "tls.key": base64.b64encode(issued.key).decode(),
        }
    )
    server.apply("secrets", secret)


def versions(server: KubeListWatchServer) -> dict[str, str]:
    return {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in server.list("secrets")}


def test_k8s_sync_creates_keeps_renews_and_follows_nodes(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    kubeconfig = str(kube_api.write_kubeconfig(tmp_path / "kubeconfig"))
    args = ["certs", "k8s-sync", "--kubeconfig", kubeconfig, "--namespace", NS]
    args += [a for s in SERVICES for a in ("--service", s)]
    args += ["--nodes-from-api", "--node-role", ROLE]

    first = cli(*args)
    assert first.returncode == 0, first.stderr
    names = {f"flagella-service-{s}" for s in SERVICES} | {"flagella-node-worker-1"}
    assert set(versions(kube_api)) == names | {"flagella-ca"}
    ca_data = decoded(kube_api.get("secrets", NS, "flagella-ca") or {})
    ca = pki.CertificateAuthority.load(ca_data["ca.crt"], ca_data["ca.key"])
    for name in sorted(names):
        secret = kube_api.get("secrets", NS, name) or {}
        assert secret["type"] == "kubernetes.io/tls"
        got = material(tmp_path / name, decoded(secret))
        assert got.ca == ca.cert_pem
        kind, _, who = name.removeprefix("flagella-").partition("-")
        assert got.identity == pki.Identity(kind, who)
        assert secret["metadata"]["annotations"]["flagella.io/identity"] == got.identity.uri
        assert got.not_after - pki.now() > dt.timedelta(hours=23)
    role = kube_api.get("roles", NS, ROLE) or {}
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "verbs": ["get"],
            "resourceNames": ["flagella-node-worker-1"],
        }
    ]

    # Nothing to do: nothing written, not even the Role.
    before, role_version = versions(kube_api), role["metadata"]["resourceVersion"]
    second = cli(*args)
    assert second.returncode == 0, second.stderr
    assert "0 written" in second.stdout
    assert versions(kube_api) == before
    assert (kube_api.get("roles", NS, ROLE) or {})["metadata"]["resourceVersion"] == role_version

    # A leaf with an hour left is renewed; the others stay.
    short = ca.issue(pki.service("lb"), dns=["lb"], lifetime=dt.timedelta(hours=1))
    replace_leaf(kube_api, "flagella-service-lb", short)
    before = versions(kube_api)
    third = cli(*args)
    assert third.returncode == 0, third.stderr
    assert "issued spiffe://flagella/service/lb: expires" in third.stdout
    after = versions(kube_api)
    assert {n for n in after if after[n] != before[n]} == {"flagella-service-lb"}
    renewed = material(
        tmp_path / "lb", decoded(kube_api.get("secrets", NS, "flagella-service-lb") or {})
    )
    assert renewed.not_after - pki.now() > dt.timedelta(hours=23)

    # A node joins: its Secret, and the datapath may read it too.
    kube_api.apply("nodes", node("worker-2", "10.0.0.12"))
    fourth = cli(*args)
    assert fourth.returncode == 0, fourth.stderr
    joined = material(
        tmp_path / "w2", decoded(kube_api.get("secrets", NS, "flagella-node-worker-2") or {})
    )
    assert joined.identity == pki.node("worker-2")
    # The endpoint service dials a datapath at its node's address.
    assert "10.0.0.12" in ips_of(joined.cert)
    assert (kube_api.get("roles", NS, ROLE) or {})["rules"][0]["resourceNames"] == [
        "flagella-node-worker-1",
        "flagella-node-worker-2",
    ]

    # The datapath's side: its node's Secret into a folder, once; again, nothing.
    out = tmp_path / "node-tls"
    fetch = ["certs", "k8s-fetch", "--kubeconfig", kubeconfig, "--namespace", NS]
    fetch += ["--secret", "flagella-node-worker-2", "--out", str(out)]
    fetched = cli(*fetch)
    assert fetched.returncode == 0, fetched.stderr
    got = pki.load_material(out / "tls.crt", out / "tls.key", out / "ca.crt")
    assert got.identity == pki.node("worker-2")
    assert oct((out / "tls.key").stat().st_mode & 0o777) == "0o600"
    again = cli(*fetch)
    assert again.returncode == 0
    assert "wrote" not in again.stdout


def test_k8s_fetch_of_a_missing_secret_fails_after_waiting(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    kubeconfig = str(kube_api.write_kubeconfig(tmp_path / "kubeconfig"))
    res = cli(
        "certs", "k8s-fetch", "--kubeconfig", kubeconfig, "--secret", "flagella-node-nope",
        "--out", str(tmp_path / "x"), "--wait", "1",
    )  # fmt: skip
    assert res.returncode == 1
    assert "flagella-node-nope" in res.stderr
    assert not (tmp_path / "x" / "tls.key").exists()


def test_folder_sync_is_idempotent_renews_and_owns_each_identity_folder(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    args = ["certs", "sync", "--out", str(out), "--service", "ipam", "--node", "host-1=10.1.0.1"]
    args += ["--operator", "compose", "--owner", f"service={os.getuid()}:{os.getgid()}"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert "4 written" in first.stdout  # the CA and three leaves
    assert oct((out / "ca").stat().st_mode & 0o777) == "0o700"
    for kind, name in (("service", "ipam"), ("node", "host-1"), ("operator", "compose")):
        folder = out / kind / name
        got = pki.load_material(folder / "tls.crt", folder / "tls.key", folder / "ca.crt")
        assert got.identity == pki.Identity(kind, name)
    node_cert = (out / "node" / "host-1" / "tls.crt").read_bytes()
    assert ips_of(node_cert) == {"127.0.0.1", "::1", "10.1.0.1"}
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    second = cli(*args)
    assert "0 written" in second.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps

    # A leaf with an hour left (and one with a bad key) is re-issued, the CA kept.
    ca = pki.CertificateAuthority.load(
        (out / "ca" / "ca.crt").read_bytes(), (out / "ca" / "ca.key").read_bytes()
    )
    short = ca.issue(pki.node("host-1"), dns=["host-1"], lifetime=dt.timedelta(hours=1))
    pki.write_bundle(out / "node" / "host-1", short, ca.cert_pem, overwrite=True)
    (out / "service" / "ipam" / "tls.key").write_bytes(pki.key_pem(pki.new_key()))
    third = cli(*args)
    assert "issued spiffe://flagella/node/host-1: expires" in third.stdout
    assert "issued spiffe://flagella/service/ipam: key does not match" in third.stdout
    assert "2 written" in third.stdout
    assert (out / "ca" / "ca.crt").read_bytes() == ca.cert_pem

    # The node moved: its certificate names the new address.
    moved = cli(*[a.replace("10.1.0.1", "10.1.0.2") for a in args])
    assert "issued spiffe://flagella/node/host-1: serves other names" in moved.stdout
    assert "10.1.0.2" in ips_of((out / "node" / "host-1" / "tls.crt").read_bytes())

    # A foreign CA in the folder's place: a new CA, every leaf re-issued.
    other = pki.CertificateAuthority.create(lifetime=dt.timedelta(hours=2))
    pki.write_files(out / "ca", {"ca.crt": other.cert_pem, "ca.key": other.key_pem}, overwrite=True)
    fourth = cli(*args)
    assert "issued ca: expires" in fourth.stdout
    assert "4 written" in fourth.stdout


def test_sync_refuses_bad_input_naming_it(tmp_path: Path) -> None:
    res = cli("certs", "sync", "--out", str(tmp_path), "--service", "Bad_Name")
    assert res.returncode != 0
    assert "Bad_Name" in res.stderr
    res = cli("certs", "sync", "--out", str(tmp_path), "--owner", "service=me")
    assert res.returncode != 0
    assert "--owner 'service=me'" in res.stderr
    res = cli("certs", "sync", "--out", str(tmp_path), "--node", "n1=10.0.0.300")
    assert res.returncode != 0
    assert "--node 'n1=10.0.0.300'" in res.stderr
    res = cli("certs", "sync", "--out", str(tmp_path), "--hours", "4", "--renew-before", "8")
    assert res.returncode != 0
    assert "renewal window" in res.stderr


def test_k8s_sync_with_an_external_ca_uses_it_and_never_writes_it(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    """The cert-manager overlay: cert-manager keeps the CA (a TLS Secret) and
    the services' Secrets; certgen issues the node Secrets from that CA."""
    kubeconfig = str(kube_api.write_kubeconfig(tmp_path / "kubeconfig"))
    args = ["certs", "k8s-sync", "--kubeconfig", kubeconfig, "--external-ca", "--nodes-from-api"]
    missing = cli(*args)
    assert missing.returncode == 1
    assert "flagella/flagella-ca is kept elsewhere" in missing.stderr
    assert kube_api.get("secrets", NS, "flagella-ca") is None

    ca = pki.CertificateAuthority.create()
    kube_api.apply(
        "secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {"name": "flagella-ca", "namespace": NS},
            "data": {
                "tls.crt": base64.b64encode(ca.cert_pem).decode(),
                "tls.key": base64.b64encode(ca.key_pem).decode(),
            },
        },
    )
    version = (kube_api.get("secrets", NS, "flagella-ca") or {})["metadata"]["resourceVersion"]
    made = cli(*args)
    assert made.returncode == 0, made.stderr
    assert set(versions(kube_api)) == {"flagella-ca", "flagella-node-worker-1"}
    got = material(
        tmp_path / "n", decoded(kube_api.get("secrets", NS, "flagella-node-worker-1") or {})
    )
    assert got.ca == ca.cert_pem
    assert versions(kube_api)["flagella-ca"] == version


ETCD_SECRETS = {
    "flagella-etcd-server-tls": "etcd",
    **{f"flagella-{s}-etcd-tls": f"flagella-{s}" for s in SERVICES},
    "flagella-etcd-root-tls": "root",
}
ETCD_FLAGS = [
    "--etcd-server",
    "etcd",
    *(a for u in (*SERVICES, "root") for a in ("--etcd-client", u)),
]


def common_name(cert: bytes) -> str:
    return x509.load_pem_x509_certificate(cert).subject.rfc4514_string().removeprefix("CN=")


def dns_of(cert: bytes) -> set[str]:
    san = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    return set(san.value.get_values_for_type(x509.DNSName))


def test_k8s_sync_keeps_etcds_ca_and_certificates_apart(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    """With --etcd-server/--etcd-client: the etcd CA in flagella-etcd-ca
    (not the cluster CA), etcd's server certificate naming its Service and
    every member, and a client certificate per etcd user whose CN is the
    user; kept, and renewed, like the rest."""
    kubeconfig = str(kube_api.write_kubeconfig(tmp_path / "kubeconfig"))
    args = ["certs", "k8s-sync", "--kubeconfig", kubeconfig, "--service", "ipam", *ETCD_FLAGS]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert "etcd: 6 certificates, 7 written" in first.stdout
    assert set(versions(kube_api)) == {
        "flagella-ca",
        "flagella-service-ipam",
        "flagella-etcd-ca",
        *ETCD_SECRETS,
    }
    etcd_ca = decoded(kube_api.get("secrets", NS, "flagella-etcd-ca") or {})
    cluster_ca = decoded(kube_api.get("secrets", NS, "flagella-ca") or {})
    assert etcd_ca["ca.crt"] != cluster_ca["ca.crt"]
    assert common_name(etcd_ca["ca.crt"]) == "flagella etcd CA"
    for name, cn in ETCD_SECRETS.items():
        secret = kube_api.get("secrets", NS, name) or {}
        assert secret["type"] == "kubernetes.io/tls"
        got = material(tmp_path / name, decoded(secret))
        assert got.ca == etcd_ca["ca.crt"], name
        assert common_name(got.cert) == cn, name
    server = decoded(kube_api.get("secrets", NS, "flagella-etcd-server-tls") or {})["tls.crt"]
    assert {
        "etcd",
        "etcd.flagella",
        "etcd.flagella.svc",
        "etcd.flagella.svc.cluster.local",
        "*.etcd-peer",
        "*.etcd-peer.flagella.svc",
        "*.etcd-peer.flagella.svc.cluster.local",
        "localhost",
    } <= dns_of(server)
    assert "127.0.0.1" in ips_of(server)

    before = versions(kube_api)
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert "etcd: 6 certificates, 0 written" in again.stdout
    assert versions(kube_api) == before

    # Root's certificate, re-issued with another CN: put right (and only it).
    ca = pki.CertificateAuthority.load(etcd_ca["ca.crt"], etcd_ca["ca.key"])
    wrong = ca.issue(pki.operator("etcd-root"), common_name="flagella-ipam")
    replace_leaf(kube_api, "flagella-etcd-root-tls", wrong)
    before = versions(kube_api)
    fixed = cli(*args)
    assert "etcd: issued spiffe://flagella/operator/etcd-root (CN root): CN is" in fixed.stdout
    after = versions(kube_api)
    assert {n for n in after if after[n] != before[n]} == {"flagella-etcd-root-tls"}
    root_data = decoded(kube_api.get("secrets", NS, "flagella-etcd-root-tls") or {})
    assert common_name(root_data["tls.crt"]) == "root"


def test_folder_sync_issues_etcds_certificates_into_their_own_folder(tmp_path: Path) -> None:
    out, etcd_out = tmp_path / "tls", tmp_path / "etcd-tls"
    me = f"{os.getuid()}:{os.getgid()}"
    args = ["certs", "sync", "--out", str(out), "--etcd-out", str(etcd_out)]
    args += ["--etcd-server", "etcd=172.29.0.10", "--etcd-client", "ipam", "--etcd-client", "root"]
    args += ["--owner", f"etcd-service={me}"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert "etcd: 3 certificates, 4 written" in first.stdout
    assert sorted(p.name for p in etcd_out.iterdir()) == ["ca", "ipam", "root", "server"]
    assert oct((etcd_out / "ca").stat().st_mode & 0o777) == "0o700"
    ca = (etcd_out / "ca" / "ca.crt").read_bytes()
    for folder, cn in (("server", "etcd"), ("ipam", "flagella-ipam"), ("root", "root")):
        got = pki.load_material(*(etcd_out / folder / f for f in ("tls.crt", "tls.key", "ca.crt")))
        assert (got.ca, common_name(got.cert)) == (ca, cn)
    server = (etcd_out / "server" / "tls.crt").read_bytes()
    assert ips_of(server) == {"127.0.0.1", "::1", "172.29.0.10"}
    assert "etcd" in dns_of(server)
    assert "etcd: 3 certificates, 0 written" in cli(*args).stdout

    for bad, problem in (
        (["--etcd-client", "datapath"], "no etcd user for 'datapath'"),
        (["--etcd-server", "etcd=10.0.0.300"], "--etcd-server 'etcd=10.0.0.300'"),
        (["--owner", "etcd-nobody=1"], "--owner 'etcd-nobody=1'"),
    ):
        res = cli(*args, *bad)
        assert res.returncode != 0, bad
        assert problem in res.stderr, res.stderr
    res = cli("certs", "sync", "--out", str(out), "--etcd-client", "ipam")
    assert res.returncode != 0
    assert "--etcd-out" in res.stderr
