"""flagella.cni.rpc against HTTP/2 servers that do what grpc's server seldom
or never does, written with the h2 library (an independent HTTP/2 stack):
padding, CONTINUATION frames, Huffman-coded and table-indexed trailers,
PING and SETTINGS mid-call, small windows, RST_STREAM, GOAWAY, HTTP errors,
missing grpc-status, and connections that drop. Each server is a thread
answering one connection on a unix socket."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from flagella.cni import rpc

Scenario = Callable[[h2.connection.H2Connection, socket.socket, int, bytes], None]


def grpc_body(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


class FakeServer:
    def __init__(self, path: Path, scenario: Scenario, settings: dict[int, int] | None = None):
        self.path = path
        self.scenario = scenario
        self.settings = settings or {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.received_headers: list[tuple[str, str]] = []
        self.error: BaseException | None = None

    def _serve(self) -> None:
        try:
            conn_sock, _ = self.listener.accept()
        except OSError:
            return
        with conn_sock:
            try:
                self._run(conn_sock)
            except (OSError, h2.exceptions.ProtocolError):
                pass
            except BaseException as exc:  # surfaced by the test
                self.error = exc

    def _run(self, sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        conn.initiate_connection()
        if self.settings:
            conn.update_settings(self.settings)
        sock.sendall(conn.data_to_send())
        body = bytearray()
        while True:
            data = sock.recv(65536)
            if not data:
                return
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    self.received_headers = list(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    self.scenario(conn, sock, event.stream_id, bytes(body[5:]))
            sock.sendall(conn.data_to_send())

    def __enter__(self) -> str:
        self.thread.start()
        return f"unix:{self.path}"

    def __exit__(self, *exc: object) -> None:
        self.listener.close()
        self.thread.join(10)
        if self.error is not None:
            raise self.error


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "h2.sock"


OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def answer(
    message: bytes, *, pad: int | None = None, trailers: list[tuple[str, str]] | None = None
) -> Scenario:
    def run(conn: h2.connection.H2Connection, sock: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(sid, OK_HEADERS)
        conn.send_data(sid, grpc_body(message), pad_length=pad)
        conn.send_headers(sid, trailers or [("grpc-status", "0")], end_stream=True)

    return run


def call(target: str, request: bytes = b"req", timeout: float = 10) -> bytes:
    return rpc.unary_call(target, "/t.S/M", request, timeout)


def test_padded_data_and_request_headers(sock_path: Path) -> None:
    server = FakeServer(sock_path, answer(b"padded", pad=200))
    with server as target:
        assert call(target) == b"padded"
    got = dict(server.received_headers)
    assert got[":method"] == "POST"
    assert got[":path"] == "/t.S/M"
    assert got["content-type"] == "application/grpc"
    assert got["te"] == "trailers"
    assert got["grpc-timeout"] == "10000m"


def test_long_huffman_trailers_in_continuation_frames(sock_path: Path) -> None:
    message = "no such thing: " + "x" * 40_000  # past one frame: CONTINUATION follows
    scenario = answer(b"", trailers=[("grpc-status", "5"), ("grpc-message", message)])
    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert (err.value.code, err.value.details) == (rpc.NOT_FOUND, message)


def test_trailers_only_response(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(
            sid,
            [*OK_HEADERS, ("grpc-status", "9"), ("grpc-message", "not%20now%3A%20later")],
            end_stream=True,
        )

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert (err.value.code, err.value.details) == (rpc.FAILED_PRECONDITION, "not now: later")


def test_ping_and_settings_mid_call(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.ping(b"12345678")
        conn.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 32768})
        conn.send_headers(sid, OK_HEADERS)
        conn.send_data(sid, grpc_body(b"after ping"))
        conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)

    with FakeServer(sock_path, scenario) as target:
        assert call(target) == b"after ping"


def test_a_small_server_window_makes_the_client_wait(sock_path: Path) -> None:
    def echo(conn: h2.connection.H2Connection, s: socket.socket, sid: int, body: bytes) -> None:
        conn.send_headers(sid, OK_HEADERS)
        data = grpc_body(body)
        while data:  # within the client's window and frame size
            size = min(len(data), conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
            conn.send_data(sid, data[:size])
            data = data[size:]
        conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)

    body = bytes(range(256)) * 400  # 100 KiB through a 1000-byte window
    settings = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000}
    with FakeServer(sock_path, echo, settings) as target:
        assert call(target, body) == body


@pytest.mark.parametrize(
    ("error_code", "status"),
    [
        (0x7, rpc.UNAVAILABLE),
        (0x8, rpc.CANCELLED),
        (0x2, rpc.INTERNAL),
        (0xB, rpc.RESOURCE_EXHAUSTED),
    ],
)
def test_rst_stream(sock_path: Path, error_code: int, status: int) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.reset_stream(sid, error_code)

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert err.value.code == status


def test_goaway_before_the_stream_is_unavailable(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.close_connection(last_stream_id=0)

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert err.value.code == rpc.UNAVAILABLE


def test_goaway_after_the_stream_still_answers(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(sid, OK_HEADERS)
        s.sendall(conn.data_to_send())
        # GOAWAY (last stream: this one, NO_ERROR) by hand: h2 would stop
        # sending after its own.
        s.sendall(b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + sid.to_bytes(4, "big") + bytes(4))
        conn.send_data(sid, grpc_body(b"finished"))
        conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)

    with FakeServer(sock_path, scenario) as target:
        assert call(target) == b"finished"


@pytest.mark.parametrize(
    ("http", "status"),
    [
        ("503", rpc.UNAVAILABLE),
        ("404", rpc.UNIMPLEMENTED),
        ("401", rpc.UNAUTHENTICATED),
        ("500", rpc.UNKNOWN),
    ],
)
def test_http_errors_map_to_grpc_status(sock_path: Path, http: str, status: int) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(sid, [(":status", http)], end_stream=True)

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert err.value.code == status


def test_missing_grpc_status_is_unknown(sock_path: Path) -> None:
    scenario = answer(b"x", trailers=[("other", "1")])
    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert err.value.code == rpc.UNKNOWN


def test_two_messages_to_a_unary_call_is_internal(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(sid, OK_HEADERS)
        conn.send_data(sid, grpc_body(b"one") + grpc_body(b"two"))
        conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert err.value.code == rpc.INTERNAL


def test_gzip_compressed_message(sock_path: Path) -> None:
    import gzip

    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        packed = gzip.compress(b"squeezed" * 100)
        conn.send_headers(sid, [*OK_HEADERS, ("grpc-encoding", "gzip")])
        conn.send_data(sid, b"\x01" + len(packed).to_bytes(4, "big") + packed)
        conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)

    with FakeServer(sock_path, scenario) as target:
        assert call(target) == b"squeezed" * 100


def test_connection_dropped_mid_response_is_unavailable(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(sid, OK_HEADERS)
        conn.send_data(sid, grpc_body(b"partial"))
        s.sendall(conn.data_to_send())
        s.shutdown(socket.SHUT_RDWR)

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert err.value.code == rpc.UNAVAILABLE


def test_oversized_frame_is_a_protocol_error(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(sid, OK_HEADERS)
        s.sendall(conn.data_to_send())
        # A DATA frame of 20000 bytes: over the 16384 the client allows.
        s.sendall((20000).to_bytes(3, "big") + b"\x00\x00" + sid.to_bytes(4, "big") + b"\0" * 20000)

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target)
    assert err.value.code == rpc.INTERNAL


def test_silent_server_hits_the_deadline(sock_path: Path) -> None:
    def scenario(conn: h2.connection.H2Connection, s: socket.socket, sid: int, _: bytes) -> None:
        conn.send_headers(sid, OK_HEADERS)  # and never more

    with FakeServer(sock_path, scenario) as target, pytest.raises(rpc.RpcError) as err:
        call(target, timeout=0.5)
    assert err.value.code == rpc.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    ("target", "family", "address", "authority"),
    [
        ("unix:/run/x.sock", socket.AF_UNIX, "/run/x.sock", "localhost"),
        ("unix:///run/x.sock", socket.AF_UNIX, "/run/x.sock", "localhost"),
        ("unix:rel.sock", socket.AF_UNIX, "rel.sock", "localhost"),
        ("unix-abstract:flagella", socket.AF_UNIX, "\0flagella", "localhost"),
        ("127.0.0.1:50053", socket.AF_INET, ("127.0.0.1", 50053), "127.0.0.1:50053"),
        ("ipv4:10.0.0.1:80", socket.AF_INET, ("10.0.0.1", 80), "10.0.0.1:80"),
        ("[::1]:5", socket.AF_INET6, ("::1", 5), "[::1]:5"),
        ("ipv6:[::1]:5", socket.AF_INET6, ("::1", 5), "[::1]:5"),
        (
            "dns:///endpoint.kube-system:50053",
            socket.AF_INET,
            ("endpoint.kube-system", 50053),
            "endpoint.kube-system:50053",
        ),
        ("dns:localhost:7", socket.AF_INET, ("localhost", 7), "localhost:7"),
        ("endpoint.svc", socket.AF_INET, ("endpoint.svc", 443), "endpoint.svc:443"),
    ],
)
def test_targets(target: str, family: int, address: object, authority: str) -> None:
    got = rpc.parse_target(target)
    assert (got.family, got.address, got.authority) == (family, address, authority)


@pytest.mark.parametrize("target", ["unix:", "unix://rel", "[::1", "host:port", "host:0", ":80"])
def test_bad_targets(target: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        rpc.parse_target(target)


@pytest.mark.parametrize(
    ("seconds", "header"),
    [
        (30, b"30000m"),
        (0.0001, b"1m"),
        (1.5, b"1500m"),
        (200_000, b"200000S"),
        (10**9, b"16666667M"),
        (10**11, b"27777778H"),
    ],
)
def test_grpc_timeout_header(seconds: float, header: bytes) -> None:
    assert rpc.grpc_timeout(seconds) == header


def test_percent_decoding() -> None:
    assert rpc.percent_decode(b"a%20b%zz%2") == "a b%zz%2"
    assert rpc.percent_decode("é".encode()) == "é"
    assert rpc.percent_decode(b"%C3%A9") == "é"
