"""Mutual TLS for the gRPC ports and the peer channels, reloading the
certificate files when they change.

Server side: grpc's dynamic SSL credentials ask a fetcher for a new
configuration at every handshake; ours answers from `TlsFiles`, which
re-reads the files (at most once a second) when their inode, size or mtime
changed. New connections get the new certificate; open ones, and their
streams, are left alone.

Client side: a grpc channel's credentials are fixed when it is made, so
`ReloadingChannel` is a facade that makes a new channel when the files
changed and sends new calls over it, while the calls already on the old
channel (a Watch* stream) finish there; the old channel is closed when its
last call is done. Stubs made on the facade keep working throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
from cryptography import x509

from flagella.common.pki import Identity, TlsFileError, TlsMaterial, identity_of, load_material

log = logging.getLogger(__name__)

#: Where a service finds its certificate, key and CA unless told otherwise.
DEFAULT_DIR = Path("/etc/flagella/tls")


@dataclass(frozen=True)
class TlsPaths:
    cert: Path
    key: Path
    ca: Path

    @classmethod
    def in_dir(cls, directory: Path | str) -> TlsPaths:
        d = Path(directory)
        return cls(d / "tls.crt", d / "tls.key", d / "ca.crt")


def _signature(paths: TlsPaths) -> tuple[tuple[int, int, int] | None, ...]:
    out: list[tuple[int, int, int] | None] = []
    for p in (paths.cert, paths.key, paths.ca):
        try:
            st = os.stat(p)  # follows symlinks: a Secret volume swaps ..data
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class TlsFiles:
    """A certificate, key and CA file, checked, and re-read when they
    change. Thread-safe: grpc's handshake threads call `latest()` too."""

    def __init__(
        self,
        paths: TlsPaths,
        *,
        check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.paths = paths
        self.check_interval = check_interval
        self.clock = clock
        self._lock = threading.Lock()
        self._signature = _signature(paths)
        # Raises TlsFileError: a service does not start on bad files.
        self._current = load_material(paths.cert, paths.key, paths.ca)
        self._checked = clock()
        self._failed_signature: tuple[Any, ...] | None = None

    @property
    def current(self) -> TlsMaterial:
        return self._current

    def latest(self) -> TlsMaterial:
        """The files as they are now (checked at most every check_interval);
        files that changed but are unusable (half-way through a rotation,
        expired) leave the previous material in place, with a warning."""
        with self._lock:
            now = self.clock()
            if now - self._checked < self.check_interval:
                return self._current
            self._checked = now
            sig = _signature(self.paths)
            if sig == self._signature:
                return self._current
            try:
                material = load_material(self.paths.cert, self.paths.key, self.paths.ca)
            except TlsFileError as exc:
                if sig != self._failed_signature:
                    self._failed_signature = sig
                    log.warning(
                        "new certificate files not usable; keeping the loaded ones",
                        extra={"file": exc.path, "problem": exc.problem},
                    )
                return self._current
            self._signature = sig
            self._current = material
        log.info(
            "certificate files reloaded",
            extra={"identity": material.identity.uri, "not_after": material.not_after.isoformat()},
        )
        return material


# --- server side ---


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Credentials that require a client certificate from the CA and pick
    up new files at the next handshake."""

    def config(m: TlsMaterial) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    served = files.current

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        nonlocal served
        latest = files.latest()
        if latest is served:
            return None
        served = latest
        return config(latest)

    # grpc documents None as "no change"; its type stubs do not say so.
    fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
    return grpc.dynamic_ssl_server_credentials(
        config(served), fetcher, require_client_authentication=True
    )


class Unauthenticated(Exception):
    """The caller has no usable identity (no certificate, an expired one,
    one naming no flagella identity)."""


PeerCert = tuple[Identity | None, dt.datetime, str]


def parse_peer(pem: bytes) -> PeerCert:
    """(identity or None, not_after, why no identity) of a PEM certificate."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        return identity_of(cert), cert.not_valid_after_utc, ""
    except ValueError as exc:
        return None, cert.not_valid_after_utc, str(exc)


def peer_identity(
    auth_context: Mapping[str, Sequence[bytes]],
    at: dt.datetime,
    parse: Callable[[bytes], PeerCert] = parse_peer,
) -> Identity:
    """The identity of a call's peer, from the certificate its connection
    was made with (parse: e.g. a cached parse_peer). Raises Unauthenticated.
    The handshake checked the certificate's dates when the connection was
    made; a long-lived connection can outlive it, hence the check of
    not_after on every call."""
    pems = auth_context.get("x509_pem_cert")
    if not pems:
        raise Unauthenticated("no client certificate")
    identity, not_after, problem = parse(bytes(pems[0]))
    if at >= not_after:
        raise Unauthenticated(f"client certificate expired at {not_after:%Y-%m-%d %H:%M:%S}Z")
    if identity is None:
        raise Unauthenticated(f"client certificate {problem}")
    return identity


# --- client side ---


def channel_credentials(material: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(material.ca, material.key, material.cert)


Make = Callable[[grpc.ChannelCredentials], grpc.aio.Channel]


class ReloadingChannel(grpc.aio.Channel):
    """A grpc.aio channel presenting the current certificate files: new
    calls go over a channel made with the latest files; calls already made
    finish on the channel they started on."""

    def __init__(self, files: TlsFiles, make: Make) -> None:
        self._files = files
        self._make = make
        self._material = files.current
        self._channel = make(channel_credentials(self._material))
        self._inflight: dict[grpc.aio.Channel, int] = {self._channel: 0}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def open_channels(self) -> int:
        """The current channel and the old ones still carrying calls."""
        return len(self._inflight)

    def current(self) -> grpc.aio.Channel:
        """The channel new calls go over."""
        latest = self._files.latest()
        if latest is not self._material and not self._closed:
            old = self._channel
            self._material = latest
            self._channel = self._make(channel_credentials(latest))
            self._inflight[self._channel] = 0
            log.info("peer channel uses new certificate", extra={"identity": latest.identity.uri})
            if self._inflight.get(old) == 0:
                self._retire(old)
        return self._channel

    def _track(self, channel: grpc.aio.Channel, call: Any) -> None:
        self._inflight[channel] += 1

        def done(_: object) -> None:
            if channel not in self._inflight:
                return  # the facade was closed
            self._inflight[channel] -= 1
            if self._inflight[channel] == 0 and channel is not self._channel:
                self._retire(channel)

        call.add_done_callback(done)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        self._inflight.pop(channel, None)
        with contextlib.suppress(RuntimeError):  # no loop: nothing can be in flight
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _multicallable(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        made: dict[grpc.aio.Channel, Any] = {}

        def call(*cargs: Any, **ckwargs: Any) -> Any:
            ch = self.current()
            mc = made.get(ch)
            if mc is None:
                made.clear()  # the old channel's multicallable is not needed any more
                mc = made[ch] = getattr(ch, kind)(*args, **kwargs)
            result = mc(*cargs, **ckwargs)
            self._track(ch, result)
            return result

        return _MultiCallable(call)

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("stream_stream", args, kwargs)

    async def close(self, grace: float | None = None) -> None:
        self._closed = True
        channels = list(self._inflight)
        self._inflight.clear()
        for ch in channels:
            with contextlib.suppress(Exception):
                await ch.close(grace)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _MultiCallable:
    """What a stub holds: dispatches each call to the current channel."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def target_options(target: str) -> list[tuple[str, str]]:
    """Channel options for TLS to target: a unix socket's authority is its
    path, which no certificate names; its server answers as 'localhost'."""
    if target.startswith("unix:"):
        return [("grpc.ssl_target_name_override", "localhost")]
    return []


def secure_channel(
    target: str,
    files: TlsFiles,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] | None = None,
) -> ReloadingChannel:
    """A reloading mTLS channel to target (host:port or unix:PATH; the
    server's certificate must name the host, 'localhost' for a socket)."""
    opts = [*options, *target_options(target)]
    return ReloadingChannel(
        files,
        lambda creds: grpc.aio.secure_channel(
            target, creds, options=opts, interceptors=interceptors
        ),
    )
