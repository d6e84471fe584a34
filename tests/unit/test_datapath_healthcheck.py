"""healthCheckNodePort answers (flagella.datapath.healthcheck): what each port
says, from the node's services; and a real listener on loopback."""

from __future__ import annotations

import asyncio
import json

from harness.net import free_port

from flagella.datapath.bpf.lb import Backend, Frontend, Service
from flagella.datapath.healthcheck import HealthCheckServers, PortState, answer, desired


def svc(sid: int, name: str, port: int, *backends: Backend) -> Service:
    return Service(
        sid, (Frontend("10.96.0.1", 80, 6, sid),), backends, name=name, health_check_port=port
    )


def test_desired_counts_active_local_backends_once_per_address() -> None:
    want = desired(
        [
            svc(
                1,
                "shop/web:http",
                31000,
                Backend(1, "10.0.0.1", 80, local=True),
                Backend(2, "10.0.1.1", 80),
            ),
            # Another port of the same Service: the same pod counts once.
            svc(2, "shop/web:https", 31000, Backend(3, "10.0.0.1", 443, local=True)),
            svc(3, "shop/api", 31001, Backend(4, "10.0.0.2", 80, state=2, local=True)),
            svc(4, "shop/plain", 0, Backend(5, "10.0.0.3", 80, local=True)),
        ]
    )
    assert want == {31000: PortState("shop", "web", 1), 31001: PortState("shop", "api", 0)}
    ok = answer(want[31000]).decode()
    assert ok.startswith("HTTP/1.1 200 OK\r\n")
    assert json.loads(ok.split("\r\n\r\n", 1)[1]) == {
        "service": {"namespace": "shop", "name": "web"},
        "localEndpoints": 1,
        "serviceProxyHealthy": True,
    }
    assert answer(want[31001]).decode().startswith("HTTP/1.1 503 Service Unavailable\r\n")


def test_listeners_open_answer_and_close() -> None:
    async def run() -> None:
        port = free_port()
        servers = HealthCheckServers(["127.0.0.1"])

        async def get() -> str:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            data = await reader.read()
            writer.close()
            return data.decode()

        await servers.apply({port: PortState("shop", "web", 2)})
        assert (await get()).startswith("HTTP/1.1 200 OK")
        await servers.apply({port: PortState("shop", "web", 0)})
        assert (await get()).startswith("HTTP/1.1 503")
        await servers.apply({})
        try:
            await get()
        except OSError:
            pass
        else:
            raise AssertionError("the port still answers")
        await servers.close()

    asyncio.run(run())
