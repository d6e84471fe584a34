#!/usr/bin/env python3
"""flagella-healthcheck: the container healthcheck of a flagella service.

Calls grpc.health.v1.Health/Check and exits 0 only when the answer is SERVING.
It speaks just enough HTTP/2 (h2c, as grpc's insecure channel does) with the
standard library, so a check costs a bare Python start-up (~20 ms of CPU)
instead of importing grpcio every few seconds in every container.

    flagella-healthcheck [ADDRESS] [--service NAME] [--timeout SECONDS]
                         [--tls-cert F --tls-key F --tls-ca F | --insecure]

ADDRESS is host:port or unix:PATH; without it, the address the service
listens on is read from its FLAGELLA_<SVC>_LISTEN variable (0.0.0.0 and [::]
become loopback). The service wants mutual TLS: the probe presents the
service's own certificate, found as the service finds it (FLAGELLA_<SVC>_TLS_*,
FLAGELLA_TLS_*, then /etc/flagella/tls/), and speaks plaintext only when the
service does (--insecure, FLAGELLA_INSECURE=true).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import ssl
import struct
import sys
from collections.abc import Mapping

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
SERVING = 1


class ProbeError(Exception):
    pass


def listen_address(environ: Mapping[str, str]) -> str:
    """The address from FLAGELLA_<SVC>_LISTEN, as a client dials it."""
    # FLAGELLA_<SVC>_LISTEN exactly: not _METRICS_LISTEN, _HEALTH_LISTEN, ...
    found = sorted(v for k, v in environ.items() if re.fullmatch(r"FLAGELLA_[A-Z]+_LISTEN", k))
    if len(found) != 1:
        raise ProbeError("give an address: no single FLAGELLA_<SVC>_LISTEN in the environment")
    address = found[0]
    if address.startswith("unix:"):
        return address
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


def service_setting(environ: Mapping[str, str], option: str, default: str) -> str:
    """An option as the service reads it: FLAGELLA_<SVC>_<OPTION>, then
    FLAGELLA_<OPTION>, then the default."""
    own = sorted(
        v
        for k, v in environ.items()
        if k.startswith("FLAGELLA_") and k.endswith(f"_{option}") and k != f"FLAGELLA_{option}"
    )
    if len(own) == 1:
        return own[0]
    return environ.get(f"FLAGELLA_{option}", default)


def tls_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with the given prefix size, OR-ed into `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_str(text: str) -> bytes:
    raw = text.encode()
    return hpack_int(len(raw), 7, 0x00) + raw


def request_headers(authority: str, path: str, secure: bool = False) -> bytes:
    """The request's header block: static-table entries and literals without
    indexing (no Huffman, no dynamic table: nothing to keep in sync)."""
    return b"".join(
        [
            b"\x83",  # :method POST
            b"\x87" if secure else b"\x86",  # :scheme https / http
            hpack_int(4, 4, 0x00) + hpack_str(path),  # :path
            hpack_int(1, 4, 0x00) + hpack_str(authority),  # :authority
            hpack_int(31, 4, 0x00) + hpack_str("application/grpc"),  # content-type
            b"\x00" + hpack_str("te") + hpack_str("trailers"),
        ]
    )


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    header = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return header + payload


def health_request(service: str) -> bytes:
    message = b""
    if service:
        raw = service.encode()
        message = b"\x0a" + varint(len(raw)) + raw
    return b"\x00" + struct.pack(">I", len(message)) + message


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise ProbeError("truncated response message")


def parse_status(body: bytes) -> int:
    """The status field of a HealthCheckResponse in a gRPC length-prefixed message."""
    if len(body) < 5:
        raise ProbeError("no response message (the call failed)")
    if body[0] != 0:
        raise ProbeError("compressed response: not supported")
    (length,) = struct.unpack(">I", body[1:5])
    message = body[5 : 5 + length]
    status, pos = 0, 0
    while pos < len(message):
        key, pos = read_varint(message, pos)
        field, wire = key >> 3, key & 0x7
        if wire == 0:
            value, pos = read_varint(message, pos)
            if field == 1:
                status = value
        elif wire == 2:
            size, pos = read_varint(message, pos)
            pos += size
        else:
            raise ProbeError(f"unexpected wire type {wire} in response")
    return status


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ProbeError("connection closed by the server")
        buf.extend(chunk)
    return bytes(buf)


def connect(
    address: str, timeout: float, tls: ssl.SSLContext | None = None
) -> tuple[socket.socket, str]:
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(address[len("unix:") :])
        host, authority = "localhost", "localhost"
    else:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ProbeError(f"{address!r} is not host:port")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        sock, authority = socket.create_connection((host, int(port)), timeout=timeout), address
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=host)
    return sock, authority


def check(
    address: str, service: str = "", timeout: float = 2.0, tls: ssl.SSLContext | None = None
) -> int:
    """The serving status `address` reports for `service`."""
    sock, authority = connect(address, timeout, tls)
    with sock:
        sock.sendall(
            PREFACE
            + frame(SETTINGS, 0, 0)
            + frame(
                HEADERS,
                END_HEADERS,
                1,
                request_headers(authority, "/grpc.health.v1.Health/Check", tls is not None),
            )
            + frame(DATA, END_STREAM, 1, health_request(service))
        )
        body = bytearray()
        while True:
            header = recv_exact(sock, 9)
            length = int.from_bytes(header[:3], "big")
            kind, flags = header[3], header[4]
            stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
            payload = recv_exact(sock, length)
            if kind == SETTINGS and not flags & ACK:
                sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                sock.sendall(frame(PING, ACK, 0, payload))
            elif kind == GOAWAY:
                raise ProbeError("the server sent GOAWAY")
            elif kind == RST_STREAM and stream == 1:
                raise ProbeError("the server reset the call")
            elif kind == DATA and stream == 1:
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                body.extend(payload)
            if stream == 1 and kind in (DATA, HEADERS) and flags & END_STREAM:
                return parse_status(bytes(body))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flagella-healthcheck", description=__doc__)
    parser.add_argument("address", nargs="?", help="host:port or unix:PATH")
    parser.add_argument("--service", default="", help="health service name ('' = server)")
    parser.add_argument("--timeout", type=float, default=2.0)
    env = os.environ
    parser.add_argument(
        "--tls-cert", default=service_setting(env, "TLS_CERT", "/etc/flagella/tls/tls.crt")
    )
    parser.add_argument(
        "--tls-key", default=service_setting(env, "TLS_KEY", "/etc/flagella/tls/tls.key")
    )
    parser.add_argument(
        "--tls-ca", default=service_setting(env, "TLS_CA", "/etc/flagella/tls/ca.crt")
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=service_setting(env, "INSECURE", "").lower() in ("1", "true", "yes", "on"),
        help="plaintext, as a service run with --insecure",
    )
    args = parser.parse_args(argv)
    try:
        address = args.address or listen_address(os.environ)
        tls = None if args.insecure else tls_context(args.tls_cert, args.tls_key, args.tls_ca)
        status = check(address, args.service, args.timeout, tls)
    except (OSError, ProbeError) as exc:
        print(f"flagella-healthcheck: {args.address or 'service'}: {exc}", file=sys.stderr)
        return 1
    name = STATUS_NAMES.get(status, str(status))
    print(f"{address}: {name}")
    return 0 if status == SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
