"""Whether a service's Kubernetes watchers are listed and watching, as the
health service name "flagella.kubernetes": SERVING while the table of
every watcher is live, NOT_SERVING while the API server is away (or before
the first list). Not a readiness condition: a service without the API
server still serves what etcd holds, and its peers still need it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpc_health.v1 import health_pb2

from flagella.common.server import Readiness
from flagella.common.sync import Table

KUBERNETES_HEALTH = "flagella.kubernetes"

# Called with (every table live, why not) whenever that changes.
StatusReport = Callable[[bool, str], Awaitable[None]]


def health_report(readiness: Readiness) -> StatusReport:
    """A StatusReport that sets the health name flagella.kubernetes."""
    status = health_pb2.HealthCheckResponse

    async def report(live: bool, reason: str) -> None:
        await readiness.servicer.set(
            KUBERNETES_HEALTH, status.SERVING if live else status.NOT_SERVING
        )

    return report


async def report_liveness(
    tables: Sequence[tuple[str, Table[Any, Any]]], report: StatusReport
) -> None:
    """Report whether every (name, table) is live, at once and on each
    change (the tables say when), until cancelled."""
    changed = asyncio.Event()
    for _, table in tables:
        table.watch_liveness(changed)
    last: tuple[bool, str] | None = None
    try:
        while True:
            changed.clear()  # before reading: a change from here on wakes us
            away = [f"{name}: {table.reason}" for name, table in tables if not table.live]
            now = (not away, "; ".join(away))
            if now != last:
                await report(*now)
                last = now
            await changed.wait()
    finally:
        for _, table in tables:
            table.unwatch_liveness(changed)
