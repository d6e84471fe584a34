"""The test session's PKI: one CA, and a certificate per identity, issued on
first use (ECDSA: about a millisecond each). Spawned services get their own
certificate; tests open channels as an operator by default, or as any
identity they name."""

from __future__ import annotations

import datetime as dt
import functools
import shutil
import tempfile
from pathlib import Path

import grpc

from flagella.common import pki
from flagella.common.pki import Identity
from flagella.common.tls import target_options

OPERATOR = pki.operator("tester")
LOCAL_DNS = ("localhost",)
LOCAL_IPS = ("127.0.0.1", "::1")


class TestPki:
    """A CA in a folder, and bundles (tls.crt, tls.key, ca.crt) in
    sub-folders named after the identity."""

    __test__ = False  # not a pytest test class

    def __init__(self, root: Path, ca: pki.CertificateAuthority | None = None) -> None:
        self.root = root
        self.ca = ca or pki.CertificateAuthority.create("flagella test CA")
        self._bundles: dict[Identity, Path] = {}

    def bundle(self, identity: Identity) -> Path:
        """The folder of identity's certificate files (made once)."""
        if identity not in self._bundles:
            folder = self.root / f"{identity.kind}-{identity.name}"
            pki.write_bundle(folder, self.issue(identity), self.ca.cert_pem, overwrite=True)
            self._bundles[identity] = folder
        return self._bundles[identity]

    def issue(self, identity: Identity, lifetime: dt.timedelta = pki.LEAF_LIFETIME) -> pki.Issued:
        """A fresh certificate for identity, valid as a local server too (a
        service's also under its name, as certgen's: how a client checks
        any of its replicas reached by IP)."""
        dns = (*LOCAL_DNS, identity.name) if identity.kind == "service" else LOCAL_DNS
        return self.ca.issue(identity, dns=dns, ips=LOCAL_IPS, lifetime=lifetime)

    def args(self, identity: Identity, flag: str = "--tls") -> list[str]:
        """The service flags pointing at identity's files (--tls-cert ...;
        --etcd-cert ... with flag="--etcd")."""
        folder = self.bundle(identity)
        return [
            f"{flag}-cert", str(folder / pki.CERT_FILE),
            f"{flag}-key", str(folder / pki.KEY_FILE),
            f"{flag}-ca", str(folder / pki.CA_FILE),
        ]  # fmt: skip

    def credentials(self, identity: Identity = OPERATOR) -> grpc.ChannelCredentials:
        folder = self.bundle(identity)
        return grpc.ssl_channel_credentials(
            self.ca.cert_pem,
            (folder / pki.KEY_FILE).read_bytes(),
            (folder / pki.CERT_FILE).read_bytes(),
        )

    def channel(self, address: str, identity: Identity = OPERATOR) -> grpc.Channel:
        """A blocking channel presenting identity's certificate."""
        return grpc.secure_channel(
            address, self.credentials(identity), options=target_options(address)
        )

    def aio_channel(self, address: str, identity: Identity = OPERATOR) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            address, self.credentials(identity), options=target_options(address)
        )


@functools.cache
def session() -> TestPki:
    """The PKI of this test session (or benchmark run), in a temporary
    folder removed at exit."""
    import atexit

    root = Path(tempfile.mkdtemp(prefix="flagella-pki-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return TestPki(root)
