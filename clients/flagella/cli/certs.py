"""`flagella certs`: the cluster CA and the certificates of services, nodes
and operators, as files (tls.crt, tls.key, ca.crt: a Kubernetes TLS
Secret's layout). And where the CLI finds its own operator certificate."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from pathlib import Path

import grpc

from flagella.common import etcdauth, pki

SERVICES = ("ipam", "policy", "endpoint", "lb", "relay")
NAMESPACE = "flagella"
CA_KEY = "ca.key"


class CertsError(Exception):
    """A failure to report as one line."""


def default_names(kind: str, name: str) -> list[str]:
    """DNS names a server is reached by: in Kubernetes (the service's name
    in the flagella namespace), locally (localhost; unix sockets too)."""
    if kind == "service":
        return [
            name,
            f"{name}.{NAMESPACE}",
            f"{name}.{NAMESPACE}.svc",
            f"{name}.{NAMESPACE}.svc.cluster.local",
            "localhost",
        ]
    if kind == "node":
        return [name, "localhost"]
    return []


def etcd_server_names(name: str) -> list[str]:
    """DNS names etcd is reached by: as a service is (its client Service in
    Kubernetes), and each member through the headless <name>-peer Service
    (<pod>.<name>-peer: a wildcard)."""
    peers = f"*.{name}-peer"
    ns = NAMESPACE
    return [
        *default_names("service", name),
        *(peers, f"{peers}.{ns}", f"{peers}.{ns}.svc", f"{peers}.{ns}.svc.cluster.local"),
    ]


def load_ca(directory: str) -> pki.CertificateAuthority:
    folder = Path(directory)
    try:
        return pki.CertificateAuthority.load(
            (folder / pki.CA_FILE).read_bytes(), (folder / CA_KEY).read_bytes()
        )
    except OSError as exc:
        raise CertsError(f"cannot read the CA in {folder}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CertsError(f"the CA in {folder}: {exc}") from None


def cmd_ca(args: argparse.Namespace) -> list[Path]:
    ca = pki.CertificateAuthority.create(args.name, dt.timedelta(days=args.days))
    return pki.write_files(
        args.out, {pki.CA_FILE: ca.cert_pem, CA_KEY: ca.key_pem}, overwrite=args.force
    )


def cmd_issue(args: argparse.Namespace) -> list[Path]:
    try:
        identity = pki.Identity(args.kind, args.name)
    except ValueError as exc:
        raise CertsError(str(exc)) from None
    ca = load_ca(args.ca)
    server = args.kind != "operator"
    dns = [*default_names(args.kind, args.name), *args.dns] if server else []
    ips = ["127.0.0.1", "::1", *args.ip] if server else []
    try:
        issued = ca.issue(identity, dns=dns, ips=ips, lifetime=dt.timedelta(hours=args.hours))
    except ValueError as exc:
        raise CertsError(str(exc)) from None
    return pki.write_bundle(args.out, issued, ca.cert_pem, overwrite=args.force)


def etcd_client_identity(name: str) -> tuple[pki.Identity, str]:
    """The identity and CN (= etcd user) of an etcd client certificate: a
    service's, or root's (what `flagella etcd-auth apply` runs as)."""
    if name == etcdauth.ROOT:
        return pki.operator("etcd-root"), etcdauth.ROOT
    if name not in etcdauth.SERVICES:
        raise CertsError(
            f"no etcd user for {name!r}: one of {', '.join(etcdauth.SERVICES)}, {etcdauth.ROOT}"
        )
    return pki.service(name), etcdauth.user_of(name)


def cmd_etcd(args: argparse.Namespace) -> list[Path]:
    """etcd's server certificate, or a client certificate whose CN etcd
    takes as the user; both from the etcd CA (`flagella certs ca --name "flagella etcd CA"`)."""
    ca = load_ca(args.ca)
    lifetime = dt.timedelta(hours=args.hours)
    try:
        if args.kind == "etcd-server":
            dns = [args.name, "localhost", *args.dns]
            ips = ["127.0.0.1", "::1", *args.ip]
            # etcd ignores the URI SAN; the CN names the server in logs.
            identity = pki.service("etcd")
            issued = ca.issue(identity, dns=dns, ips=ips, lifetime=lifetime, common_name=args.name)
        else:
            identity, user = etcd_client_identity(args.name)
            issued = ca.issue(identity, lifetime=lifetime, common_name=user)
    except ValueError as exc:
        raise CertsError(str(exc)) from None
    return pki.write_bundle(args.out, issued, ca.cert_pem, overwrite=args.force)


def run(args: argparse.Namespace) -> int:
    try:
        if args.kind == "ca":
            paths = cmd_ca(args)
        elif args.kind.startswith("etcd-"):
            paths = cmd_etcd(args)
        else:
            paths = cmd_issue(args)
    except FileExistsError as exc:
        raise CertsError(str(exc)) from None
    for path in paths:
        print(path)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    certs = sub.add_parser("certs", help="create the cluster CA; issue certificates")
    csub = certs.add_subparsers(dest="kind", required=True)
    ca = csub.add_parser("ca", help="a new cluster CA (ca.crt, ca.key)")
    ca.add_argument("--out", required=True, help="folder for ca.crt and ca.key")
    ca.add_argument("--name", default="flagella cluster CA", help="the CA's common name")
    ca.add_argument("--days", type=float, default=365, help="lifetime (default 365 days)")
    ca.add_argument("--force", action="store_true", help="replace existing files")
    for kind, what in (
        ("service", f"a control-plane service ({', '.join(SERVICES)})"),
        ("node", "a node (its datapath)"),
        ("operator", "a person or tool running `flagella`"),
    ):
        p = csub.add_parser(kind, help=f"a certificate for {what}")
        p.add_argument("name", help=f"the {kind}'s name")
        p.add_argument("--ca", required=True, help="folder with ca.crt and ca.key")
        p.add_argument("--out", required=True, help="folder for tls.crt, tls.key and ca.crt")
        p.add_argument("--hours", type=float, default=24, help="lifetime (default 24 hours)")
        p.add_argument("--force", action="store_true", help="replace existing files")
        if kind != "operator":
            p.add_argument("--dns", action="append", default=[], help="another DNS name it serves")
            p.add_argument("--ip", action="append", default=[], help="another IP it serves on")
    for kind, name_help, what in (
        ("etcd-server", "etcd's host name", "etcd's server certificate"),
        (
            "etcd-client",
            f"{', '.join(etcdauth.SERVICES)} or {etcdauth.ROOT}",
            "an etcd client certificate: CN flagella-<service> (or root), etcd's user",
        ),
    ):
        p = csub.add_parser(kind, help=f"{what}, from the etcd CA")
        p.add_argument("name", help=name_help)
        p.add_argument("--ca", required=True, help="folder with the etcd CA's ca.crt and ca.key")
        p.add_argument("--out", required=True, help="folder for tls.crt, tls.key and ca.crt")
        p.add_argument("--hours", type=float, default=24, help="lifetime (default 24 hours)")
        p.add_argument("--force", action="store_true", help="replace existing files")
        if kind == "etcd-server":
            p.add_argument("--dns", action="append", default=[], help="another DNS name it serves")
            p.add_argument("--ip", action="append", default=[], help="another IP it serves on")
    certs.set_defaults(func=lambda args, clients: run(args))
    from flagella.cli import certgen  # certgen builds on this module

    certgen.add_parsers(csub)


# --- the CLI's own certificate ---


def default_tls_dir() -> str:
    if os.environ.get("FLAGELLA_TLS_DIR"):
        return os.environ["FLAGELLA_TLS_DIR"]
    return str(Path.home() / ".config" / "flagella" / "tls")


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-dir",
        default=default_tls_dir(),
        help="folder of the operator certificate (tls.crt, tls.key, ca.crt); "
        "default $FLAGELLA_TLS_DIR or ~/.config/flagella/tls",
    )
    parser.add_argument("--tls-cert", help="certificate (default: <tls-dir>/tls.crt)")
    parser.add_argument("--tls-key", help="its key (default: <tls-dir>/tls.key)")
    parser.add_argument("--tls-ca", help="the cluster CA (default: <tls-dir>/ca.crt)")
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get("FLAGELLA_INSECURE", "").lower() in ("1", "true", "yes"),
        help="plaintext, no certificate: only for a cluster started with --insecure",
    )


def channel_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials:
    """The operator's credentials from the flags."""
    folder = Path(args.tls_dir)
    try:
        material = pki.load_material(
            args.tls_cert or folder / pki.CERT_FILE,
            args.tls_key or folder / pki.KEY_FILE,
            args.tls_ca or folder / pki.CA_FILE,
        )
    except pki.TlsFileError as exc:
        raise CertsError(
            f"operator certificate: {exc} (issue one with `flagella certs operator NAME "
            "--ca CA_DIR --out ~/.config/flagella/tls`, or --insecure for a plaintext cluster)"
        ) from None
    return grpc.ssl_channel_credentials(material.ca, material.key, material.cert)
