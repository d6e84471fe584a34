"""The cluster's certificates: a CA, and leaf certificates whose one URI SAN
names who holds them (``spiffe://flagella/<kind>/<name>``).

Keys are ECDSA P-256: as strong as RSA-3072 for TLS, and generated in about a
millisecond, so issuing a certificate per test or per rotation costs nothing.
Leaves live 24 hours by default: a stolen key is useful for a day at most,
which is what makes rotation (services reload their files) mandatory rather
than optional. The CA lives a year: it only signs, and replacing it means
re-issuing everything.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TRUST_DOMAIN = "flagella"
KINDS = ("service", "node", "operator")
LEAF_LIFETIME = dt.timedelta(hours=24)
CA_LIFETIME = dt.timedelta(days=365)
# Issued certificates start a little in the past: a peer whose clock is
# behind must not see them as not yet valid.
BACKDATE = dt.timedelta(minutes=5)

# The file names of a Kubernetes TLS Secret (plus the CA, as cert-manager writes it).
CERT_FILE, KEY_FILE, CA_FILE = "tls.crt", "tls.key", "ca.crt"

_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True, order=True)
class Identity:
    """Who a certificate names: a service, a node or an operator."""

    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown identity kind {self.kind!r} (one of {', '.join(KINDS)})")
        pattern = _LABEL if self.kind == "service" else _NAME
        if not pattern.match(self.name):
            what = (
                "a lowercase DNS label"
                if self.kind == "service"
                else "letters, digits, '.', '_' or '-' (at most 253, alphanumeric at both ends)"
            )
            raise ValueError(f"invalid {self.kind} name {self.name!r}: must be {what}")

    @property
    def uri(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.kind}/{self.name}"

    def __str__(self) -> str:
        return self.uri

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """The identity a URI SAN names; ValueError if it names none."""
        prefix = f"spiffe://{TRUST_DOMAIN}/"
        if not uri.startswith(prefix):
            raise ValueError(f"{uri!r} is not a spiffe://{TRUST_DOMAIN}/ identity")
        kind, sep, name = uri[len(prefix) :].partition("/")
        if not sep:
            raise ValueError(f"{uri!r} has no <kind>/<name>")
        return cls(kind, name)


def service(name: str) -> Identity:
    return Identity("service", name)


def node(name: str) -> Identity:
    return Identity("node", name)


def operator(name: str) -> Identity:
    return Identity("operator", name)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates; a leaf signs TLS handshakes."""
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, PEM."""

    cert: bytes
    key: bytes


class CertificateAuthority:
    """The cluster CA: signs every service, node and operator certificate."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key

    @classmethod
    def create(
        cls, name: str = "flagella cluster CA", lifetime: dt.timedelta = CA_LIFETIME
    ) -> CertificateAuthority:
        key = new_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        start = now() - BACKDATE
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + BACKDATE + lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, cert: bytes, key: bytes) -> CertificateAuthority:
        ca_cert = x509.load_pem_x509_certificate(cert)
        ca_key = serialization.load_pem_private_key(key, password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA key is not an ECDSA key")
        if ca_key.public_key() != ca_cert.public_key():
            raise ValueError("the CA key does not match the CA certificate")
        return cls(ca_cert, ca_key)

    @property
    def cert_pem(self) -> bytes:
        return cert_pem(self.cert)

    @property
    def key_pem(self) -> bytes:
        return key_pem(self.key)

    def issue(
        self,
        identity: Identity,
        *,
        dns: Sequence[str] = (),
        ips: Sequence[str] = (),
        lifetime: dt.timedelta = LEAF_LIFETIME,
        not_before: dt.datetime | None = None,
        common_name: str = "",
    ) -> Issued:
        """A certificate for identity, usable as a TLS client and, when it has
        DNS or IP names, as a TLS server reached by those names. The common
        name is informative unless given: etcd reads its users from it."""
        key = new_key()
        start = not_before or (now() - BACKDATE)
        # A leaf never outlives its CA.
        end = min((not_before or now()) + lifetime, self.cert.not_valid_after_utc)
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
        names += [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        # For flagella the URI SAN is what counts; etcd takes its user from the CN.
        common_name = common_name or f"{identity.kind}/{identity.name}"[:64]
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if dns or ips:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
            .sign(self.key, hashes.SHA256())
        )
        return Issued(cert_pem(cert), key_pem(key))


def identity_of(cert: x509.Certificate) -> Identity:
    """The one flagella identity in a certificate's URI SANs; ValueError
    if it has none or several."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ValueError("has no subject alternative names") from None
    found = []
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        try:
            found.append(Identity.parse(uri))
        except ValueError:
            continue
    if len(found) != 1:
        raise ValueError(
            f"must name exactly one spiffe://{TRUST_DOMAIN}/ identity (has {len(found)})"
        )
    return found[0]


# --- files ---


class TlsFileError(Exception):
    """A certificate, key or CA file that cannot be used: names the file."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True)
class TlsMaterial:
    """The checked contents of a certificate, key and CA file."""

    cert: bytes
    key: bytes
    ca: bytes
    identity: Identity
    not_after: dt.datetime


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsFileError(path, "no such file") from None
    except OSError as exc:
        raise TlsFileError(path, f"cannot read: {exc.strerror or exc}") from None


def _load_certs(path: Path, data: bytes) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsFileError(path, "not a PEM certificate") from None
    return certs


def load_material(
    cert_path: Path | str,
    key_path: Path | str,
    ca_path: Path | str,
    *,
    at: dt.datetime | None = None,
) -> TlsMaterial:
    """Read and check the three files: readable PEM, the certificate valid
    now, issued by the CA, naming one identity, and the key its own.
    Raises TlsFileError naming the file and the problem."""
    cert_path, key_path, ca_path = Path(cert_path), Path(key_path), Path(ca_path)
    when = at or now()
    cert_data = _read(cert_path)
    cert = _load_certs(cert_path, cert_data)[0]
    key_data = _read(key_path)
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except (ValueError, TypeError):
        raise TlsFileError(key_path, "not an unencrypted PEM private key") from None
    ca_data = _read(ca_path)
    cas = _load_certs(ca_path, ca_data)
    if when >= cert.not_valid_after_utc:
        raise TlsFileError(cert_path, f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z")
    if when < cert.not_valid_before_utc:
        raise TlsFileError(
            cert_path, f"not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S}Z"
        )
    for ca in cas:
        if when >= ca.not_valid_after_utc:
            raise TlsFileError(ca_path, f"expired on {ca.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z")
    if key.public_key() != cert.public_key():
        raise TlsFileError(key_path, f"does not match the certificate in {cert_path}")
    if not any(_issued_by(cert, ca) for ca in cas):
        raise TlsFileError(cert_path, f"not issued by the CA in {ca_path}")
    try:
        identity = identity_of(cert)
    except ValueError as exc:
        raise TlsFileError(cert_path, str(exc)) from None
    return TlsMaterial(cert_data, key_data, ca_data, identity, cert.not_valid_after_utc)


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def write_files(
    directory: Path | str,
    files: dict[str, bytes],
    *,
    overwrite: bool = False,
    owner: tuple[int, int] | None = None,
) -> list[Path]:
    """Write name -> contents into directory (keys 0600, the rest 0644;
    owned by owner (uid, gid) when given). Each file is replaced atomically
    (a service reloading it never reads half of it, nor one it may not
    read). Refuses to replace an existing file unless overwrite."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / name for name in files]
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists (--force replaces it)")
    for path, data in zip(paths, files.values(), strict=True):
        tmp = path.with_name(f".{path.name}.tmp")
        mode = 0o600 if path.name.endswith(".key") else 0o644
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        if owner is not None:
            os.chown(tmp, *owner)
        os.replace(tmp, path)
    return paths


def write_bundle(
    directory: Path | str,
    issued: Issued,
    ca_cert: bytes,
    *,
    overwrite: bool = False,
    owner: tuple[int, int] | None = None,
) -> list[Path]:
    """tls.crt, tls.key and ca.crt: the layout of a Kubernetes TLS Secret.
    The key is written last, so a reloading service whose key check fails
    half way waits for the pair to match."""
    return write_files(
        directory,
        {CA_FILE: ca_cert, CERT_FILE: issued.cert, KEY_FILE: issued.key},
        overwrite=overwrite,
        owner=owner,
    )
