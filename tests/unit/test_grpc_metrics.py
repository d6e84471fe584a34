"""The gRPC client and server metrics of flagella.common.metrics on a real
grpc.aio server and channel in this process (the health service as the
peer): what each side counts for unary calls, failed calls and streams."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from flagella.common.metrics import Metrics

HEALTH = "grpc.health.v1.Health"


def sample(m: Metrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.asyncio
async def test_client_and_server_count_calls_codes_and_stream_messages() -> None:
    server_side, client_side = Metrics("server"), Metrics("client")
    server = grpc.aio.server(interceptors=[server_side.server_interceptor()])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("up", health_pb2.HealthCheckResponse.SERVING)
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", interceptors=client_side.client_interceptors()
    )
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        for _ in range(2):
            await stub.Check(health_pb2.HealthCheckRequest(service="up"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="up"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        await asyncio.sleep(0.2)
    finally:
        await channel.close()
        await server.stop(0)

    unary = {"grpc_type": "unary", "grpc_service": HEALTH, "grpc_method": "Check"}
    for side, m in (("server", server_side), ("client", client_side)):
        assert sample(m, f"grpc_{side}_started_total", **unary) == 3
        assert sample(m, f"grpc_{side}_handled_total", grpc_code="OK", **unary) == 2
        assert sample(m, f"grpc_{side}_handled_total", grpc_code="NotFound", **unary) == 1
        assert sample(m, f"grpc_{side}_handling_seconds_count", **unary) == 3
    assert sample(server_side, "grpc_server_msg_sent_total", **unary) == 2
    assert sample(client_side, "grpc_client_msg_received_total", **unary) == 2
    assert sample(client_side, "grpc_client_msg_sent_total", **unary) == 3
    stream = {"grpc_type": "server_stream", "grpc_service": HEALTH, "grpc_method": "Watch"}
    assert sample(server_side, "grpc_server_msg_sent_total", **stream) == 1
    for side, m in (("server", server_side), ("client", client_side)):
        assert sample(m, f"grpc_{side}_started_total", **stream) == 1
        assert sample(m, f"grpc_{side}_handled_total", grpc_code="Canceled", **stream) == 1
