"""`flagella etcd-auth`: print, or apply to etcd, the users and roles of
flagella.common.etcdauth (one etcd user per service, least privilege), and
enable etcd's authentication. Runs as etcd's root user: a client
certificate with CN root (`flagella certs etcd-client root`)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from flagella.cli.certs import CertsError
from flagella.common import etcdauth, pki
from flagella.common.errors import Unavailable
from flagella.common.etcd import Etcd
from flagella.common.tls import TlsFiles, TlsPaths


def _env(name: str, default: str) -> str:
    return os.environ.get(f"FLAGELLA_ETCD_{name}", default)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("etcd-auth", help="etcd users and roles of the services; enable auth")
    asub = p.add_subparsers(dest="action", required=True)
    asub.add_parser("show", help="the roles table (as docs/SECURITY.md prints it)")
    apply = asub.add_parser("apply", help="create the users and roles, enable auth (idempotent)")
    apply.add_argument(
        "--etcd-endpoints",
        default=_env("ENDPOINTS", "127.0.0.1:2379"),
        help="etcd endpoints, comma-separated (env FLAGELLA_ETCD_ENDPOINTS)",
    )
    apply.add_argument(
        "--etcd-tls-dir",
        default=_env("TLS_DIR", ""),
        help="folder of root's etcd client certificate: tls.crt, tls.key, ca.crt "
        "(env FLAGELLA_ETCD_TLS_DIR)",
    )
    apply.add_argument("--timeout", type=float, default=5.0, help="per request, seconds")
    p.set_defaults(func=lambda args, clients: run(args))


def run(args: argparse.Namespace) -> int:
    if args.action == "show":
        print(etcdauth.table())
        return 0
    if not args.etcd_tls_dir:
        raise CertsError(
            "etcd-auth apply: --etcd-tls-dir (root's etcd client certificate) is required"
        )
    try:
        files = TlsFiles(TlsPaths.in_dir(Path(args.etcd_tls_dir)))
    except pki.TlsFileError as exc:
        raise CertsError(f"root's etcd certificate: {exc}") from None
    endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]

    async def apply() -> list[str]:
        etcd = Etcd(endpoints, timeout=args.timeout, tls_files=files)
        try:
            return await etcdauth.apply(etcd)
        finally:
            await etcd.close()

    try:
        for line in asyncio.run(apply()):
            print(line)
    except (etcdauth.EtcdAuthError, Unavailable) as exc:
        raise CertsError(str(exc)) from None
    return 0
