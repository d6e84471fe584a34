"""Keepalive agreement (issue 18 item 7): a client pinging at the cluster's
keepalive time never gets GOAWAY `too_many_pings` from a flagella server,
however long its watch stream stays idle (flagella.common.keepalive)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from harness.etcd import EtcdServer
from harness.lb import service
from harness.procs import ServiceProcess
from harness.tls import OPERATOR, session

from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.api.lb.v1 import lb_pb2_grpc
from flagella.common.keepalive import Keepalive

pytestmark = pytest.mark.integration

# Short periods, set by configuration: 20 pings in the idle window.
KEEPALIVE = Keepalive(0.2, 1.0)
IDLE_S = 4.0


async def broken_by_default_server() -> tuple[float, grpc.aio.AioRpcError]:
    """The same client against a gRPC server with default ping limits (as
    flagella's were): its idle stream is cut. Shows the client really pings
    at this rate, so the test below can fail."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    start = time.monotonic()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=KEEPALIVE.client_options()
        ) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                return time.monotonic() - start, exc
            raise AssertionError("the stream ended without an error")
    finally:
        await server.stop(0)


async def idle_watch_then_change(lb: ServiceProcess) -> tuple[list[int], pb.ServiceEvent]:
    """An idle WatchServices stream held IDLE_S (no heartbeat in between),
    then a change: it must arrive on the same stream."""
    creds = session().credentials(OPERATOR)
    async with grpc.aio.secure_channel(lb.address, creds, options=KEEPALIVE.client_options()) as ch:
        call = lb_pb2_grpc.LoadBalancerServiceStub(ch).WatchServices(pb.WatchServicesRequest())
        stream = call.__aiter__()
        kinds = []
        while not kinds or kinds[-1] != pb.ServiceEvent.KIND_SYNCED:
            kinds.append((await stream.__anext__()).kind)
        # Nothing comes while idle; a broken stream would end this wait.
        next_event = asyncio.ensure_future(stream.__anext__())
        done, _ = await asyncio.wait({next_event}, timeout=IDLE_S)
        assert not done, next_event.exception() or next_event.result()
        with lb.channel() as operator:
            upsert = lb_pb2_grpc.LoadBalancerServiceStub(operator).UpsertService
            request = pb.UpsertServiceRequest(service=service("ka/a", "10.100.7.1", 80))
            await asyncio.to_thread(upsert, request, timeout=20)
        event = await asyncio.wait_for(next_event, 10)
        call.cancel()
        return kinds, event


def test_idle_watch_outlives_many_keepalive_periods(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    lb = spawn(
        "lb",
        "--etcd-endpoints",
        etcd.endpoint,
        env={"FLAGELLA_GRPC_KEEPALIVE_TIME": str(KEEPALIVE.time)},
    )

    async def both() -> tuple[
        tuple[float, grpc.aio.AioRpcError], tuple[list[int], pb.ServiceEvent]
    ]:
        return await asyncio.gather(broken_by_default_server(), idle_watch_then_change(lb))

    (cut_after, cut), (kinds, event) = asyncio.run(both())
    assert cut.code() == grpc.StatusCode.UNAVAILABLE
    assert "too many pings" in (cut.details() or "").lower()
    assert cut_after < IDLE_S

    assert kinds == [pb.ServiceEvent.KIND_RESET, pb.ServiceEvent.KIND_SYNCED]
    assert event.kind == pb.ServiceEvent.KIND_UPSERT
    assert event.service.name == "ka/a"
    assert "too_many_pings" not in lb.logs()


async def connections_to_a_silent_peer(seconds: float) -> int:
    """How many connections a client opens in seconds to a peer that
    accepts but never answers (a server too busy to finish handshakes)."""
    loop = asyncio.get_running_loop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(100)
        listener.setblocking(False)
        held: list[socket.socket] = []

        async def accept() -> None:
            while True:
                held.append((await loop.sock_accept(listener))[0])

        acceptor = asyncio.ensure_future(accept())
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        creds = session().credentials(OPERATOR)
        async with grpc.aio.secure_channel(target, creds, options=KEEPALIVE.client_options()) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            with pytest.raises(grpc.aio.AioRpcError):
                await check(health_pb2.HealthCheckRequest(), timeout=seconds, wait_for_ready=True)
        acceptor.cancel()
        for conn in held:
            conn.close()
        return len(held)


async def answered_after_start(delay: float) -> float:
    """A client calls a port nobody listens on yet; a server starts there
    after delay: how long after its start the call is answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")

    async def start_later() -> float:
        await asyncio.sleep(delay)
        await server.start()
        return time.monotonic()

    starting = asyncio.ensure_future(start_later())
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=KEEPALIVE.client_options()
        ) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            await check(health_pb2.HealthCheckRequest(), timeout=20, wait_for_ready=True)
        return time.monotonic() - await starting
    finally:
        await server.stop(0)


def test_slow_handshakes_are_waited_for_and_refused_connections_retried_fast() -> None:
    # One connection, waited on: not a new one every 0.1-0.5 s (9 in 3 s
    # before), which left a busy server a socket per abandoned attempt.
    assert asyncio.run(connections_to_a_silent_peer(2.0)) == 1
    # A peer that comes back is still found within the reconnect backoff.
    assert asyncio.run(answered_after_start(0.5)) < 1.0
