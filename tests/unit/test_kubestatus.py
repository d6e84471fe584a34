"""report_liveness: the kubernetes health name follows the watchers'
tables as their liveness changes, told by the tables (no polling)."""

from __future__ import annotations

import asyncio

from flagella.common.kubestatus import report_liveness
from flagella.common.sync import Table


async def test_reports_at_once_and_on_each_change_only() -> None:
    pods: Table[str, int] = Table("pods")
    namespaces: Table[str, int] = Table("namespaces")
    reports: list[tuple[bool, str]] = []
    got = asyncio.Event()

    async def report(live: bool, reason: str) -> None:
        reports.append((live, reason))
        got.set()

    async def next_report() -> tuple[bool, str]:
        await asyncio.wait_for(got.wait(), 0.1)  # well under any poll interval
        got.clear()
        return reports[-1]

    task = asyncio.create_task(report_liveness([("pods", pods), ("ns", namespaces)], report))
    try:
        assert await next_report() == (
            False,
            "pods: not synced yet; ns: not synced yet",
        )
        pods.set_live(True)
        assert await next_report() == (False, "ns: not synced yet")
        namespaces.set_live(True)
        assert await next_report() == (True, "")
        # Nothing changed: nothing reported.
        namespaces.set_live(True)
        await asyncio.sleep(0.05)
        assert len(reports) == 3
        pods.set_live(False, "410 Gone, relisting")
        assert await next_report() == (False, "pods: 410 Gone, relisting")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # Stopped: the tables no longer hold its event.
    assert not pods._liveness_watchers
    assert not namespaces._liveness_watchers
