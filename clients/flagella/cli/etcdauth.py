"""`flagella etcd-auth`: print, or apply to etcd, the users and roles of
flagella.common.etcdauth (one etcd user per service, least privilege), and
enable etcd's authentication. Runs as etcd's root user: a client
certificate with CN root (`flagella certs etcd-client root`). `wait`, as a
service's user, returns once etcd enforces the roles (a service's init
container in Kubernetes)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable
from pathlib import Path

from flagella.cli.certs import CertsError
from flagella.common import etcdauth, pki
from flagella.common.backoff import Backoff
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
    _connection_flags(apply, "root's etcd client certificate")
    wait = asub.add_parser(
        "wait",
        help="wait until etcd enforces its users' roles (as a service's etcd user)",
    )
    _connection_flags(wait, "a service's etcd client certificate")
    wait.add_argument("--wait", type=float, default=300, help="give up after this many seconds")
    p.set_defaults(func=lambda args, clients: run(args))


def _connection_flags(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument(
        "--etcd-endpoints",
        default=_env("ENDPOINTS", "127.0.0.1:2379"),
        help="etcd endpoints, comma-separated (env FLAGELLA_ETCD_ENDPOINTS)",
    )
    p.add_argument(
        "--etcd-tls-dir",
        default=_env("TLS_DIR", ""),
        help=f"folder of {whose}: tls.crt, tls.key, ca.crt (env FLAGELLA_ETCD_TLS_DIR)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="per request, seconds")


def run(args: argparse.Namespace) -> int:
    if args.action == "show":
        print(etcdauth.table())
        return 0
    whose = "root's" if args.action == "apply" else "a service's"
    if not args.etcd_tls_dir:
        raise CertsError(
            f"etcd-auth {args.action}: --etcd-tls-dir ({whose} etcd client certificate) is required"
        )
    try:
        files = TlsFiles(TlsPaths.in_dir(Path(args.etcd_tls_dir)))
    except pki.TlsFileError as exc:
        raise CertsError(f"{whose} etcd certificate: {exc}") from None
    endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]
    etcd = Etcd(endpoints, timeout=args.timeout, tls_files=files)
    action = apply if args.action == "apply" else wait
    try:
        for line in asyncio.run(_closing(etcd, action(etcd, args))):
            print(line, flush=True)
    except (etcdauth.EtcdAuthError, Unavailable) as exc:
        raise CertsError(str(exc)) from None
    return 0


async def _closing(etcd: Etcd, work: Awaitable[list[str]]) -> list[str]:
    try:
        return await work
    finally:
        await etcd.close()


async def apply(etcd: Etcd, args: argparse.Namespace) -> list[str]:
    return await etcdauth.apply(etcd)


async def wait(etcd: Etcd, args: argparse.Namespace) -> list[str]:
    """Until etcd enforces the roles (a service's pod starts only then: with
    authentication still off, any etcd certificate reaches every key)."""
    backoff = Backoff(0.5, 5.0)
    deadline = time.monotonic() + args.wait
    problem = "authentication is off"
    while time.monotonic() < deadline:
        try:
            if await etcdauth.enforced(etcd):
                return ["etcd enforces authentication"]
            problem = "authentication is off (or this is root's certificate)"
        except Unavailable as exc:
            problem = exc.message
        await asyncio.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
    raise CertsError(f"etcd-auth wait: after {args.wait:g} s: {problem}")
