"""Keepalive agreement (issue 18 item 7): a client pinging at the cluster's
keepalive time never gets GOAWAY `too_many_pings` from a flagella server,
however long its watch stream stays idle (flagella.common.keepalive)."""

from __future__ import annotations

import asyncio
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
