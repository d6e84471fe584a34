"""Keeping a set of certificates issued: the CA and one leaf per identity,
in a store (a folder for compose, Secrets for Kubernetes: certgen.py). The
same for etcd's certificates (`etcd_plan`), from the etcd CA in a store of
their own.

One pass (`sync`) is idempotent: a valid CA is kept, a leaf is issued only
when it is missing, unreadable, not issued by the current CA, names another
identity, does not match its key, or expires within `renew_before`; so a
CronJob (or compose's one-shot service at every `up`) can run it as often as
it likes and only what needs it changes.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from flagella.cli.certs import CA_KEY, etcd_client_identity
from flagella.common import etcdauth, pki

# A leaf is renewed once it has less than a third of its default lifetime left.
RENEW_BEFORE = dt.timedelta(hours=8)


@dataclass(frozen=True)
class Leaf:
    """A certificate to keep issued: who it names and the names it serves."""

    identity: pki.Identity
    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()
    #: The CN, where it matters: etcd takes its user from it.
    common_name: str = ""
    #: (kind, path) when not kept by identity (etcd's leaves): the kind
    #: `--owner` names, and the folder under a folder store's root.
    place: tuple[str, str] | None = None

    @property
    def kind(self) -> str:
        return self.place[0] if self.place else self.identity.kind

    @property
    def path(self) -> str:
        return self.place[1] if self.place else f"{self.identity.kind}/{self.identity.name}"

    def __str__(self) -> str:
        uri = self.identity.uri
        return f"{uri} (CN {self.common_name})" if self.common_name else uri


@dataclass(frozen=True)
class Bundle:
    """What a store holds for one leaf (PEM)."""

    cert: bytes
    key: bytes
    ca: bytes


@dataclass(frozen=True)
class Change:
    """One thing a pass wrote, and why."""

    what: str  # "ca" or the identity's URI
    reason: str

    def __str__(self) -> str:
        return f"{self.what}: {self.reason}"


class Store(Protocol):
    def read_ca(self) -> tuple[bytes, bytes] | None: ...
    def write_ca(self, cert: bytes, key: bytes) -> None: ...
    def read_leaf(self, leaf: Leaf) -> Bundle | None: ...
    def write_leaf(self, leaf: Leaf, bundle: Bundle) -> None: ...


def plan(
    services: Iterable[str],
    nodes: Mapping[str, Sequence[str]],
    operators: Iterable[str],
    *,
    names: Callable[[str, str], list[str]],
) -> list[Leaf]:
    """The leaves of a cluster: servers get names(kind, name) as DNS names,
    and loopback (callers in the same pod or on the node); operators are
    clients only. nodes: name -> its addresses (where its datapath listens,
    the address the endpoint service dials and checks)."""
    loopback = ("127.0.0.1", "::1")
    leaves = [Leaf(pki.service(s), tuple(names("service", s)), loopback) for s in services]
    leaves += [
        Leaf(pki.node(n), tuple(names("node", n)), (*loopback, *ips)) for n, ips in nodes.items()
    ]
    leaves += [Leaf(pki.operator(o)) for o in operators]
    return leaves


ETCD_SERVER = "server"
#: The `--owner` kinds of etcd's leaves.
ETCD_KINDS = ("etcd-server", "etcd-service", "etcd-root")


def etcd_plan(
    server: tuple[str, Sequence[str]] | None,
    clients: Iterable[str],
    *,
    names: Callable[[str], list[str]],
) -> list[Leaf]:
    """etcd's leaves: its server certificate (server: its name and
    addresses; names(name) as DNS names, loopback too), and a client
    certificate per user (a service's, or root), whose CN etcd takes as the
    user. CertsError for an unknown user."""
    leaves = []
    if server is not None:
        name, ips = server
        leaves.append(
            Leaf(
                pki.service("etcd"),
                tuple(names(name)),
                ("127.0.0.1", "::1", *ips),
                common_name=name,
                place=("etcd-server", ETCD_SERVER),
            )
        )
    for client in dict.fromkeys(clients):
        identity, user = etcd_client_identity(client)
        kind = "etcd-root" if client == etcdauth.ROOT else "etcd-service"
        leaves.append(Leaf(identity, common_name=user, place=(kind, client)))
    return leaves


def common_name_of(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def ca_problem(
    found: tuple[bytes, bytes] | None, min_left: dt.timedelta, at: dt.datetime
) -> tuple[str, pki.CertificateAuthority | None]:
    """Why the stored CA must be replaced ("" if it is kept), and the CA."""
    if found is None:
        return "missing", None
    try:
        ca = pki.CertificateAuthority.load(*found)
    except ValueError as exc:
        return f"unusable ({exc})", None
    if at + min_left >= ca.cert.not_valid_after_utc:
        return f"expires {ca.cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z", None
    return "", ca


def leaf_problem(
    bundle: Bundle | None,
    leaf: Leaf,
    ca: pki.CertificateAuthority,
    renew_before: dt.timedelta,
    at: dt.datetime,
) -> str:
    """Why the stored leaf must be (re-)issued; "" if it is good."""
    if bundle is None:
        return "missing"
    try:
        cert = x509.load_pem_x509_certificate(bundle.cert)
        key = serialization.load_pem_private_key(bundle.key, password=None)
    except (ValueError, TypeError):
        return "unreadable"
    if bundle.ca.strip() != ca.cert_pem.strip():
        return "carries another CA"
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return "not issued by the current CA"
    if key.public_key() != cert.public_key():
        return "key does not match"
    try:
        if pki.identity_of(cert) != leaf.identity:
            return f"names {pki.identity_of(cert)}"
    except ValueError as exc:
        return str(exc)
    if leaf.common_name and common_name_of(cert) != leaf.common_name:
        return f"CN is {common_name_of(cert)!r}"
    if at + renew_before >= cert.not_valid_after_utc:
        return f"expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z"
    if served_names(cert) != served_names_of(leaf):
        return "serves other names"
    return ""


def served_names(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    """The DNS names and IP addresses a certificate names."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return set(san.get_values_for_type(x509.DNSName)), ips


def served_names_of(leaf: Leaf) -> tuple[set[str], set[str]]:
    return set(leaf.dns), {str(ipaddress.ip_address(ip)) for ip in leaf.ips}


def sync(
    store: Store,
    leaves: Sequence[Leaf],
    *,
    lifetime: dt.timedelta = pki.LEAF_LIFETIME,
    ca_lifetime: dt.timedelta = pki.CA_LIFETIME,
    renew_before: dt.timedelta = RENEW_BEFORE,
    ca_name: str = "flagella cluster CA",
    at: dt.datetime | None = None,
) -> list[Change]:
    """One pass: what it wrote (empty when everything was good)."""
    if renew_before >= lifetime:
        raise ValueError("the renewal window must be shorter than the lifetime")
    when = at or pki.now()
    changes = []
    # A CA that cannot sign a whole leaf lifetime is replaced (and with it
    # every leaf, as none is issued by the new one).
    reason, ca = ca_problem(store.read_ca(), lifetime, when)
    if ca is None:
        ca = pki.CertificateAuthority.create(ca_name, ca_lifetime)
        store.write_ca(ca.cert_pem, ca.key_pem)
        changes.append(Change("ca", reason))
    for leaf in leaves:
        reason = leaf_problem(store.read_leaf(leaf), leaf, ca, renew_before, when)
        if not reason:
            continue
        issued = ca.issue(
            leaf.identity,
            dns=leaf.dns,
            ips=leaf.ips,
            lifetime=lifetime,
            common_name=leaf.common_name,
        )
        store.write_leaf(leaf, Bundle(issued.cert, issued.key, ca.cert_pem))
        changes.append(Change(str(leaf), reason))
    return changes


# --- a folder ---


def _read_optional(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class FolderStore:
    """<root>/ca/{ca.crt,ca.key} and <root>/<kind>/<name>/{tls.crt,tls.key,
    ca.crt} (an etcd leaf: <root>/<its place>/): one folder per identity,
    so a container mounts exactly its own. owners: kind -> (uid, gid) of
    that kind's files (a service running as another user must be able to
    read its key)."""

    def __init__(self, root: Path | str, owners: dict[str, tuple[int, int]] | None = None) -> None:
        self.root = Path(root)
        self.owners = owners or {}

    def folder(self, leaf: Leaf) -> Path:
        return self.root / leaf.path

    def read_ca(self) -> tuple[bytes, bytes] | None:
        cert = _read_optional(self.root / "ca" / pki.CA_FILE)
        key = _read_optional(self.root / "ca" / CA_KEY)
        return None if cert is None or key is None else (cert, key)

    def write_ca(self, cert: bytes, key: bytes) -> None:
        folder = self.root / "ca"
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # the CA key: nobody but this tool
        pki.write_files(folder, {pki.CA_FILE: cert, CA_KEY: key}, overwrite=True)

    def read_leaf(self, leaf: Leaf) -> Bundle | None:
        folder = self.folder(leaf)
        parts = [
            _read_optional(folder / name) for name in (pki.CERT_FILE, pki.KEY_FILE, pki.CA_FILE)
        ]
        if any(p is None for p in parts):
            return None
        cert, key, ca = (p or b"" for p in parts)
        return Bundle(cert, key, ca)

    def write_leaf(self, leaf: Leaf, bundle: Bundle) -> None:
        pki.write_bundle(
            self.folder(leaf),
            pki.Issued(bundle.cert, bundle.key),
            bundle.ca,
            overwrite=True,
            owner=self.owners.get(leaf.kind),
        )
