"""flagella-cni's own gRPC client (flagella.cni.rpc, HTTP/2 on the standard
library) against a real grpc.aio server: answers, every status code with its
message, trailers-only errors, deadlines, large messages both ways (flow
control), unix and TCP targets, and UNAVAILABLE when nothing listens."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness.net import free_port

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.cni import rpc, wire

pytestmark = pytest.mark.integration

SERVICE = "test.Echo"


class _Handlers(grpc.GenericRpcHandler):
    """Raw-bytes methods: Echo answers what it got, Size answers N bytes
    (N = the request as an ASCII number), Fail aborts with the code and
    message in its request ("CODE message"), Sleep waits before answering,
    Meta answers the request's metadata."""

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        method = details.method  # type: ignore[attr-defined]
        if not method.startswith(f"/{SERVICE}/"):
            return None
        name = method.rsplit("/", 1)[1]

        async def echo(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            return request

        async def size(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            n = int(request)
            return (b"0123456789abcdef" * (n // 16 + 1))[:n]

        async def fail(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            code, _, message = request.decode().partition(" ")
            await context.abort(grpc.StatusCode[code], message)
            raise AssertionError("unreachable")

        async def sleep(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            await asyncio.sleep(float(request))
            return b"late"

        async def meta(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            md = context.invocation_metadata() or ()
            return "\n".join(f"{k}={v}" for k, v in md).encode()

        handlers = {"Echo": echo, "Size": size, "Fail": fail, "Sleep": sleep, "Meta": meta}
        if name not in handlers:
            return None
        return grpc.unary_unary_rpc_method_handler(handlers[name])


class _Endpoint(endpoint_pb2_grpc.EndpointServiceServicer):
    async def CreateEndpoint(
        self, request: endpoint_pb2.CreateEndpointRequest, context: Any
    ) -> endpoint_pb2.CreateEndpointResponse:
        return endpoint_pb2.CreateEndpointResponse(
            endpoint=endpoint_pb2.Endpoint(id=7, container_id=request.container_id),
            result=endpoint_pb2.CniResult(
                cni_version="1.1.0",
                interfaces=[endpoint_pb2.CniInterface(name=request.ifname, mac="aa:bb", mtu=1400)],
                ips=[endpoint_pb2.CniIPConfig(address="10.0.0.5/32", gateway="10.0.0.1")],
                dns=endpoint_pb2.CniDNS(nameservers=[request.labels["dns"]]),
            ),
        )

    async def GetStatus(
        self, request: endpoint_pb2.GetStatusRequest, context: Any
    ) -> endpoint_pb2.EndpointServiceStatus:
        return endpoint_pb2.EndpointServiceStatus(ready=False, dependencies={"ipam": "down"})


class Server:
    """A grpc.aio server on its own event loop thread."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: grpc.aio.Server | None = None

    def start(self) -> Server:
        self.thread.start()

        async def up() -> None:
            self.server = grpc.aio.server()
            self.server.add_generic_rpc_handlers((_Handlers(),))
            endpoint_pb2_grpc.add_EndpointServiceServicer_to_server(_Endpoint(), self.server)
            for address in self.addresses:
                self.server.add_insecure_port(address)
            await self.server.start()

        asyncio.run_coroutine_threadsafe(up(), self.loop).result(10)
        return self

    def stop(self) -> None:
        assert self.server is not None
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    sock = tmp_path_factory.mktemp("rpc") / "s.sock"
    port = free_port()
    srv = Server([f"unix:{sock}", f"127.0.0.1:{port}"]).start()
    try:
        yield {"unix": f"unix:{sock}", "unix3": f"unix://{sock}", "tcp": f"127.0.0.1:{port}"}
    finally:
        srv.stop()


def call(target: str, method: str, request: bytes, timeout: float = 10.0) -> bytes:
    return rpc.unary_call(target, f"/{SERVICE}/{method}", request, timeout)


@pytest.mark.parametrize("kind", ["unix", "unix3", "tcp"])
def test_unary_call_answers(server: dict[str, str], kind: str) -> None:
    assert call(server[kind], "Echo", b"hello") == b"hello"
    assert call(server[kind], "Echo", b"") == b""


@pytest.mark.parametrize("size", [0, 1, 16_379, 16_384, 70_000, 3 << 20])
def test_large_responses_cross_frames_and_windows(server: dict[str, str], size: int) -> None:
    """Bigger than a frame (16 KiB), the default window (64 KiB) and our
    receive window (1 MiB): flow control gives the window back."""
    got = call(server["unix"], "Size", str(size).encode())
    assert len(got) == size
    assert got == (b"0123456789abcdef" * (size // 16 + 1))[:size]


@pytest.mark.parametrize("size", [65_535, 65_536, 200_000, 2 << 20])
def test_large_requests_wait_for_the_servers_window(server: dict[str, str], size: int) -> None:
    body = os.urandom(size)
    assert call(server["tcp"], "Echo", body) == body


def test_a_response_over_the_limit_is_resource_exhausted(server: dict[str, str]) -> None:
    with pytest.raises(rpc.RpcError) as err:
        call(server["unix"], "Size", str(rpc.MAX_RECEIVE_MESSAGE + 1).encode())
    assert err.value.code == rpc.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "code",
    [c for c in grpc.StatusCode if c not in (grpc.StatusCode.OK,)],
    ids=lambda c: c.name,
)
def test_status_codes_and_messages_come_through(server: dict[str, str], code: Any) -> None:
    message = f"{code.name} happened: 50% of «naïve» clients\tfail ✓"
    with pytest.raises(rpc.RpcError) as err:
        call(server["unix"], "Fail", f"{code.name} {message}".encode())
    assert (err.value.code, err.value.name) == (code.value[0], code.name)
    assert err.value.details == message


def test_unknown_method_is_unimplemented(server: dict[str, str]) -> None:
    with pytest.raises(rpc.RpcError) as err:
        call(server["tcp"], "Nope", b"")
    assert err.value.code == rpc.UNIMPLEMENTED


def test_deadline_exceeded(server: dict[str, str]) -> None:
    t = time.monotonic()
    with pytest.raises(rpc.RpcError) as err:
        call(server["unix"], "Sleep", b"5", timeout=0.3)
    assert err.value.code == rpc.DEADLINE_EXCEEDED
    assert time.monotonic() - t < 4  # it gave up well before the server answered


def test_the_server_sees_the_deadline_and_metadata(server: dict[str, str]) -> None:
    got = rpc.unary_call(
        server["tcp"], f"/{SERVICE}/Meta", b"", 10.0, metadata=[("X-Flagella", "yes")]
    ).decode()
    assert "x-flagella=yes" in got.split("\n")
    assert "user-agent=" in got


def test_nothing_listening_is_unavailable(tmp_path: Path) -> None:
    for target in (f"127.0.0.1:{free_port()}", f"unix:{tmp_path}/missing.sock"):
        with pytest.raises(rpc.RpcError) as err:
            call(target, "Echo", b"x", timeout=5)
        assert err.value.code == rpc.UNAVAILABLE, target


def test_a_socket_that_is_not_listening_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # bound, never listening: connect is refused
    try:
        with pytest.raises(rpc.RpcError) as err:
            call(f"unix:{path}", "Echo", b"x", timeout=5)
        assert err.value.code == rpc.UNAVAILABLE
    finally:
        s.close()


def test_endpoint_messages_through_the_generated_servicer(server: dict[str, str]) -> None:
    request = wire.create_endpoint_request(
        container_id="c1",
        netns_path="/run/netns/x",
        ifname="eth0",
        pod_name="",
        pod_namespace="",
        labels={"dns": "10.96.0.10"},
        resolve_labels_from_kubernetes=False,
        node="n1",
        mtu=1400,
    )
    resp = rpc.unary_call(server["unix"], wire.SERVICE + "CreateEndpoint", request, 10.0)
    assert wire.create_endpoint_result(resp) == {
        "interfaces": [{"name": "eth0", "mac": "aa:bb", "mtu": 1400}],
        "ips": [{"address": "10.0.0.5/32", "interface": 0, "gateway": "10.0.0.1"}],
        "routes": [],
        "dns": {"nameservers": ["10.96.0.10"]},
    }
    status = rpc.unary_call(server["tcp"], wire.SERVICE + "GetStatus", b"", 10.0)
    assert wire.endpoint_service_status(status) == (False, {"ipam": "down"})
