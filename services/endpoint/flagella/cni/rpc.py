"""A minimal gRPC client: one unary call over one HTTP/2 connection (RFC
9113, cleartext with prior knowledge, as grpc's insecure channels speak it)
on a unix or TCP socket, on the standard library.

flagella-cni runs once per CNI operation and makes a single call; grpcio's
import, its event engine and channel set-up cost several times what the call
itself does. This speaks the same protocol (PROTOCOL-HTTP2.md of gRPC):
request headers as HPACK literals, the length-prefixed message, flow control
both ways, the server's headers and trailers decoded with a full HPACK
decoder, grpc-status/grpc-message, grpc-timeout and a local deadline, and
grpc's status for transport failures (UNAVAILABLE when nothing listens or the
connection drops, DEADLINE_EXCEEDED when time runs out)."""

from __future__ import annotations

# The C module under `socket`: the same socket objects and errors, without
# socket.py's import of selectors, array and its enum conversions (~4 ms of
# a plugin run).
import _socket as socket
import time

from flagella.cni import hpack

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

# gRPC status codes.
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16
CODE_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip

# HTTP/2 frame types, flags, settings and error codes.
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
MAX_WINDOW = (1 << 31) - 1
# What we let the server send before it must wait for a WINDOW_UPDATE, per
# stream and for the connection.
RECEIVE_WINDOW = 1 << 20
# grpcio's default limit on a received message.
MAX_RECEIVE_MESSAGE = 4 << 20

# RST_STREAM error codes -> gRPC status (PROTOCOL-HTTP2.md).
_RST_STATUS = {
    0x7: UNAVAILABLE,  # REFUSED_STREAM: not processed, safe to retry
    0x8: CANCELLED,  # CANCEL
    0xB: RESOURCE_EXHAUSTED,  # ENHANCE_YOUR_CALM
    0xC: PERMISSION_DENIED,  # INADEQUATE_SECURITY
}
# HTTP status -> gRPC status, for responses without grpc-status
# (http-grpc-status-mapping.md).
_HTTP_STATUS = {
    400: INTERNAL,
    401: UNAUTHENTICATED,
    403: PERMISSION_DENIED,
    404: UNIMPLEMENTED,
    429: UNAVAILABLE,
    502: UNAVAILABLE,
    503: UNAVAILABLE,
    504: UNAVAILABLE,
}
USER_AGENT = b"flagella-cni grpc-h2/1"


class RpcError(Exception):
    """A call that did not end with status OK."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(f"{code_name(code)}: {details}")
        self.code = code
        self.details = details

    @property
    def name(self) -> str:
        return code_name(self.code)


def code_name(code: int) -> str:
    return CODE_NAMES[code] if 0 <= code < len(CODE_NAMES) else f"CODE_{code}"


class _ProtocolError(Exception):
    """The server broke HTTP/2: the call fails INTERNAL."""


class Target:
    """Where a gRPC target string (grpc's naming) points."""

    def __init__(self, family: int, address: str | tuple[str, int], authority: str) -> None:
        self.family = family
        self.address = address
        self.authority = authority

    def __repr__(self) -> str:
        return f"Target({self.family}, {self.address!r}, {self.authority!r})"


def parse_target(target: str) -> Target:
    """unix:PATH, unix:///ABS_PATH, unix-abstract:NAME, or a TCP address:
    HOST:PORT, [V6]:PORT, dns:[//AUTHORITY/]HOST[:PORT], ipv4:ADDR:PORT,
    ipv6:[ADDR]:PORT (port 443 when left out, as grpc does)."""
    if target.startswith("unix:"):
        path = target[len("unix:") :]
        if path.startswith("//"):
            # unix://ABS_PATH: the authority must be empty.
            path = path[2:]
            if not path.startswith("/"):
                raise ValueError(f"{target!r}: unix:// needs an absolute path")
        if not path:
            raise ValueError(f"{target!r}: no socket path")
        return Target(socket.AF_UNIX, path, "localhost")
    if target.startswith("unix-abstract:"):
        return Target(socket.AF_UNIX, "\0" + target[len("unix-abstract:") :], "localhost")
    rest = target
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
            if scheme == "dns:" and rest.startswith("//"):
                rest = rest[2:].partition("/")[2]  # drop the DNS server authority
            break
    if rest.startswith("["):
        host, sep, tail = rest[1:].partition("]")
        if not sep:
            raise ValueError(f"{target!r}: unterminated [")
        port_text = tail[1:] if tail.startswith(":") else ""
        if tail and not tail.startswith(":"):
            raise ValueError(f"{target!r}: junk after ]")
        authority_host = f"[{host}]"
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
        authority_host = host
    elif ":" in rest:  # a bare IPv6 address
        host, port_text, authority_host = rest, "", f"[{rest}]"
    else:
        host, port_text, authority_host = rest, "", rest
    if not host:
        raise ValueError(f"{target!r}: no host")
    try:
        port = int(port_text) if port_text else 443
    except ValueError:
        raise ValueError(f"{target!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{target!r}: port {port} is out of range")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return Target(family, (host, port), f"{authority_host}:{port}")


def grpc_timeout(seconds: float) -> bytes:
    """The grpc-timeout header value: at most 8 digits and a unit."""
    for unit, per_second in ((b"m", 1000), (b"S", 1), (b"M", 1 / 60), (b"H", 1 / 3600)):
        value = max(1, -int(-seconds * per_second // 1))  # ceiling: never earlier
        if value < 100_000_000:
            return str(value).encode() + unit
    return b"99999999H"


def percent_decode(raw: bytes) -> str:
    """grpc-message: percent-encoded UTF-8."""
    out = bytearray()
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == 0x25 and _is_hex(raw[i + 1 : i + 3]):
            out.append(int(raw[i + 1 : i + 3], 16))
            i += 3
            continue
        out.append(c)
        i += 1
    return out.decode("utf-8", "replace")


def _is_hex(pair: bytes) -> bool:
    return len(pair) == 2 and all(c in b"0123456789abcdefABCDEF" for c in pair)


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + (stream & MAX_WINDOW).to_bytes(4, "big")
        + payload
    )


def _window_update(stream: int, increment: int) -> bytes:
    return _frame(WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


class _Call:
    """One unary call on a fresh connection (stream 1)."""

    STREAM = 1

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray()
        self.decoder = hpack.Decoder()
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_MAX_FRAME
        self.conn_send_window = DEFAULT_WINDOW
        self.stream_send_window = DEFAULT_WINDOW
        self.conn_unacked = 0
        self.stream_unacked = 0
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.data = bytearray()
        self.closed = False  # the server ended the stream
        self.reset: int | None = None
        self.goaway: tuple[int, int] | None = None

    # --- socket ---

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RpcError(DEADLINE_EXCEEDED, "Deadline Exceeded")
        return left

    def send(self, data: bytes) -> None:
        self.sock.settimeout(self._remaining())
        self.sock.sendall(data)

    def _fill(self, need: int) -> None:
        while len(self.buf) < need:
            self.sock.settimeout(self._remaining())
            chunk = self.sock.recv(max(65536, need - len(self.buf)))
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            self.buf += chunk

    def read_frame(self) -> tuple[int, int, int, bytes]:
        self._fill(9)
        length = int.from_bytes(self.buf[0:3], "big")
        kind, flags = self.buf[3], self.buf[4]
        stream = int.from_bytes(self.buf[5:9], "big") & MAX_WINDOW
        if length > DEFAULT_MAX_FRAME:  # we never raise SETTINGS_MAX_FRAME_SIZE
            raise _ProtocolError(f"frame of {length} bytes over the {DEFAULT_MAX_FRAME} allowed")
        self._fill(9 + length)
        payload = bytes(self.buf[9 : 9 + length])
        del self.buf[: 9 + length]
        return kind, flags, stream, payload

    # --- the call ---

    def start(self, headers: Iterable[tuple[bytes, bytes]], message: bytes) -> None:
        """Preface, settings, a larger connection window, the request
        headers, and as much of the message as the initial windows allow:
        usually everything, in one write."""
        settings = b"".join(
            key.to_bytes(2, "big") + value.to_bytes(4, "big")
            for key, value in (
                (SETTINGS_ENABLE_PUSH, 0),
                (SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW),
            )
        )
        block = hpack.encode(headers)
        out = bytearray(PREFACE)
        out += _frame(SETTINGS, 0, 0, settings)
        out += _window_update(0, RECEIVE_WINDOW - DEFAULT_WINDOW)
        first, rest = block[: self.peer_max_frame], block[self.peer_max_frame :]
        out += _frame(HEADERS, 0 if rest else END_HEADERS, self.STREAM, first)
        while rest:
            piece, rest = rest[: self.peer_max_frame], rest[self.peer_max_frame :]
            out += _frame(CONTINUATION, 0 if rest else END_HEADERS, self.STREAM, piece)
        pos = 0
        while True:
            size = min(
                len(message) - pos,
                self.conn_send_window,
                self.stream_send_window,
                self.peer_max_frame,
            )
            if size <= 0 and pos < len(message):
                # Blocked by flow control: send what we have, wait for the
                # server to open its windows (or to answer early).
                if out:
                    self.send(bytes(out))
                    out.clear()
                self.handle(*self.read_frame())
                if self.closed or self.reset is not None:
                    return  # the server answered without the rest
                continue
            chunk = message[pos : pos + size]
            pos += size
            self.conn_send_window -= size
            self.stream_send_window -= size
            last = pos >= len(message)
            out += _frame(DATA, END_STREAM if last else 0, self.STREAM, chunk)
            if last:
                break
        self.send(bytes(out))

    def run(self) -> None:
        while not self.closed and self.reset is None:
            self.handle(*self.read_frame())

    def drain(self) -> None:
        """After a failed write: read whatever the server sent before it
        closed (an early answer), ignoring how the reading ends."""
        try:
            self.run()
        except (OSError, RpcError, _ProtocolError):
            return

    def _header_block(self, flags: int, stream: int, fragment: bytes) -> bytes:
        """The whole block: this fragment and its CONTINUATION frames."""
        block = bytearray(fragment)
        while not flags & END_HEADERS:
            kind, flags, cont_stream, payload = self.read_frame()
            if kind != CONTINUATION or cont_stream != stream:
                raise _ProtocolError("header block interrupted")
            block += payload
            if len(block) > 1 << 20:
                raise _ProtocolError("header block too large")
        return bytes(block)

    def handle(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == DATA:
            if stream == 0:
                raise _ProtocolError("DATA on stream 0")
            self._count_received(stream, len(payload))
            if stream != self.STREAM:
                return
            if self.headers is None or self.closed:
                raise _ProtocolError("DATA before the response headers or after the end")
            self.data += _unpad(flags, payload)
            if len(self.data) > MAX_RECEIVE_MESSAGE + 5 + 1024:
                raise RpcError(
                    RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({len(self.data)} vs. "
                    f"{MAX_RECEIVE_MESSAGE})",
                )
            if flags & END_STREAM:
                self.closed = True
        elif kind == HEADERS:
            if stream == 0:
                raise _ProtocolError("HEADERS on stream 0")
            fragment = _unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                fragment = fragment[5:]
            end_stream = bool(flags & END_STREAM)
            # Decode every block, ours or not: the table is the connection's.
            try:
                decoded = self.decoder.decode(self._header_block(flags, stream, fragment))
            except hpack.HpackError as exc:
                raise _ProtocolError(f"header block: {exc}") from None
            if stream != self.STREAM:
                return
            if self.closed:
                raise _ProtocolError("HEADERS after the end of the stream")
            if self.headers is None:
                self.headers = decoded
                if end_stream:  # trailers-only
                    self.trailers = decoded
            else:
                if not end_stream:
                    raise _ProtocolError("trailers without END_STREAM")
                self.trailers = decoded
            if end_stream:
                self.closed = True
        elif kind == RST_STREAM:
            if len(payload) != 4:
                raise _ProtocolError("RST_STREAM of the wrong size")
            if stream == self.STREAM:
                self.reset = int.from_bytes(payload, "big")
        elif kind == SETTINGS:
            if stream != 0:
                raise _ProtocolError("SETTINGS on a stream")
            if flags & ACK:
                return
            if len(payload) % 6:
                raise _ProtocolError("SETTINGS of the wrong size")
            for i in range(0, len(payload), 6):
                key = int.from_bytes(payload[i : i + 2], "big")
                value = int.from_bytes(payload[i + 2 : i + 6], "big")
                if key == SETTINGS_INITIAL_WINDOW_SIZE:
                    if value > MAX_WINDOW:
                        raise _ProtocolError("initial window too large")
                    self.stream_send_window += value - self.peer_initial_window
                    self.peer_initial_window = value
                elif key == SETTINGS_MAX_FRAME_SIZE:
                    if not DEFAULT_MAX_FRAME <= value <= (1 << 24) - 1:
                        raise _ProtocolError("max frame size out of range")
                    self.peer_max_frame = value
            self.send(_frame(SETTINGS, ACK, 0))
        elif kind == PING:
            if len(payload) != 8 or stream != 0:
                raise _ProtocolError("bad PING")
            if not flags & ACK:
                self.send(_frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            if len(payload) < 8:
                raise _ProtocolError("GOAWAY too short")
            last = int.from_bytes(payload[0:4], "big") & MAX_WINDOW
            self.goaway = (last, int.from_bytes(payload[4:8], "big"))
            if last < self.STREAM:
                raise RpcError(UNAVAILABLE, "the server is going away (GOAWAY)")
        elif kind == WINDOW_UPDATE:
            if len(payload) != 4:
                raise _ProtocolError("WINDOW_UPDATE of the wrong size")
            increment = int.from_bytes(payload, "big") & MAX_WINDOW
            if increment == 0:
                raise _ProtocolError("WINDOW_UPDATE of 0")
            if stream == 0:
                self.conn_send_window += increment
            elif stream == self.STREAM:
                self.stream_send_window += increment
        elif kind == PUSH_PROMISE:
            raise _ProtocolError("PUSH_PROMISE with push disabled")
        elif kind == CONTINUATION:
            raise _ProtocolError("CONTINUATION without HEADERS")
        # PRIORITY and unknown frame types are ignored (RFC 9113 4.1, 5.5).

    def _count_received(self, stream: int, size: int) -> None:
        """Flow control of what we receive: give the window back once half
        of it is used."""
        self.conn_unacked += size
        updates = b""
        if self.conn_unacked >= RECEIVE_WINDOW // 2:
            updates += _window_update(0, self.conn_unacked)
            self.conn_unacked = 0
        if stream == self.STREAM:
            self.stream_unacked += size
            if self.stream_unacked >= RECEIVE_WINDOW // 2:
                updates += _window_update(stream, self.stream_unacked)
                self.stream_unacked = 0
        if updates:
            self.send(updates)

    def result(self) -> bytes:
        """The response message, or the call's error."""
        if self.reset is not None and self.trailers is None:
            code = _RST_STATUS.get(self.reset, INTERNAL)
            raise RpcError(code, f"Stream reset by the server (HTTP/2 error {self.reset:#x})")
        headers = dict(self.headers or [])
        trailers = dict(self.trailers or [])
        status = headers.get(b":status", b"")
        if status != b"200":
            try:
                http = int(status)
            except ValueError:
                http = 0
            raise RpcError(
                _HTTP_STATUS.get(http, UNKNOWN),
                f"Received http2 header with status: {status.decode('latin-1')}",
            )
        content_type = headers.get(b"content-type", b"")
        if not content_type.startswith(b"application/grpc"):
            raise RpcError(UNKNOWN, f"unexpected content-type {content_type.decode('latin-1')!r}")
        raw_status = trailers.get(b"grpc-status")
        if raw_status is None:
            raise RpcError(UNKNOWN, "the server sent no grpc-status")
        try:
            code = int(raw_status)
        except ValueError:
            raise RpcError(UNKNOWN, f"grpc-status {raw_status!r} is not a number") from None
        if code != OK:
            raise RpcError(code, percent_decode(trailers.get(b"grpc-message", b"")))
        messages = _messages(bytes(self.data), headers.get(b"grpc-encoding", b"identity"))
        if len(messages) != 1:
            raise RpcError(INTERNAL, f"{len(messages)} response messages to a unary call")
        return messages[0]


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload:
        raise _ProtocolError("PADDED frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise _ProtocolError("padding longer than the frame")
    return payload[1 : len(payload) - pad]


def _messages(data: bytes, encoding: bytes) -> list[bytes]:
    """The length-prefixed messages of a response body."""
    out = []
    pos = 0
    while pos < len(data):
        if pos + 5 > len(data):
            raise RpcError(INTERNAL, "truncated message prefix")
        compressed = data[pos]
        length = int.from_bytes(data[pos + 1 : pos + 5], "big")
        if length > MAX_RECEIVE_MESSAGE:
            raise RpcError(
                RESOURCE_EXHAUSTED,
                f"Received message larger than max ({length} vs. {MAX_RECEIVE_MESSAGE})",
            )
        body = data[pos + 5 : pos + 5 + length]
        if len(body) != length:
            raise RpcError(INTERNAL, "truncated message")
        pos += 5 + length
        if compressed == 1:
            body = _decompress(body, encoding)
        elif compressed != 0:
            raise RpcError(INTERNAL, f"message flag {compressed}")
        out.append(body)
    return out


def _decompress(body: bytes, encoding: bytes) -> bytes:
    import zlib

    if encoding == b"gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == b"deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise RpcError(INTERNAL, f"compressed message with grpc-encoding {encoding!r}")
    d = zlib.decompressobj(wbits)
    out = d.decompress(body, MAX_RECEIVE_MESSAGE + 1)
    if len(out) > MAX_RECEIVE_MESSAGE:
        raise RpcError(RESOURCE_EXHAUSTED, "decompressed message larger than max")
    return out


def _connect(target: Target, timeout: float) -> socket.socket:
    if target.family == socket.AF_UNIX:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(target.address)
        except BaseException:
            sock.close()
            raise
        return sock
    assert isinstance(target.address, tuple)
    host, port = target.address
    # socket.create_connection: each address getaddrinfo gives, in order.
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


def unary_call(
    target: str,
    method: str,
    request: bytes,
    timeout: float,
    metadata: Iterable[tuple[str, str]] = (),
) -> bytes:
    """Call method ("/package.Service/Method") at target with a serialized
    request; the serialized response, or RpcError."""
    deadline = time.monotonic() + timeout
    try:
        where = parse_target(target)
    except ValueError as exc:
        raise RpcError(UNAVAILABLE, f"bad target: {exc}") from None
    try:
        sock = _connect(where, timeout)
    except TimeoutError:
        raise RpcError(DEADLINE_EXCEEDED, "Deadline Exceeded (connecting)") from None
    except OSError as exc:
        raise RpcError(
            UNAVAILABLE, f"failed to connect to all addresses; last error: {target}: {exc}"
        ) from None
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", method.encode()),
        (b":authority", where.authority.encode()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"user-agent", USER_AGENT),
        (b"grpc-timeout", grpc_timeout(timeout)),
        *((k.lower().encode(), v.encode()) for k, v in metadata),
    ]
    call = _Call(sock, deadline)
    try:
        call.start(headers, b"\x00" + len(request).to_bytes(4, "big") + request)
        call.run()
        return call.result()
    except TimeoutError:
        raise RpcError(DEADLINE_EXCEEDED, "Deadline Exceeded") from None
    except _ProtocolError as exc:
        raise RpcError(INTERNAL, f"HTTP/2 protocol error: {exc}") from None
    except OSError as exc:
        # Reset, broken pipe, or closed before the trailers. A server that
        # answered early and closed may have left its answer unread.
        if call.reset is None and not call.closed:
            call.drain()
        if call.reset is not None or call.closed:
            return call.result()
        raise RpcError(UNAVAILABLE, f"connection to {target} lost: {exc}") from None
    finally:
        sock.close()
