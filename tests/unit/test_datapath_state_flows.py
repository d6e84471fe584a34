"""Datapath endpoint records on disk and the flow hub (pure logic)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from flagella.datapath.flows import FlowFilter, FlowHub, FlowRecord
from flagella.datapath.state import EndpointRecord, StateDir


def record(i: int) -> EndpointRecord:
    return EndpointRecord(
        i,
        f"c{i}",
        "/run/netns/p",
        "eth0",
        f"lxc{i:x}",
        10 + i,
        "aa",
        "bb",
        [f"10.0.0.{i}/32"],
        256 + i,
        1500,
        ["10.0.0.0/24"],
    )


def test_state_dir_round_trip_and_torn_files(tmp_path: Path) -> None:
    state = StateDir(str(tmp_path))
    for i in (1, 2, 3):
        state.save(record(i))
    state.remove(2)
    state.remove(99)
    (tmp_path / "endpoints" / "7.json").write_text("{torn")
    assert state.load_all() == [record(1), record(3)]
    assert not (tmp_path / "endpoints" / "7.json").exists()


def flow(i: int, verdict: int = 2, reason: int = 130, ep: int = 1) -> FlowRecord:
    return FlowRecord(
        float(i), 1, verdict, reason, 1, "10.0.0.1", f"10.0.0.{i}", 1000, 80, 6, 256, 257, ep, 5
    )


async def test_hub_filters_ring_and_live_subscribers() -> None:
    hub = FlowHub(capacity=3, subscriber_queue=2)
    for i in range(5):
        hub.publish(flow(i))
    assert [f.time for f in hub.recent(FlowFilter(), 10)] == [2.0, 3.0, 4.0]
    assert hub.recent(FlowFilter(ip="10.0.0.3"), 10) == [flow(3)]

    only_ep2 = hub.follow(FlowFilter(endpoint_ids=frozenset({2})))
    first = asyncio.ensure_future(anext(only_ep2))
    await asyncio.sleep(0)
    hub.publish(flow(10, ep=1))
    hub.publish(flow(11, ep=2))
    assert (await asyncio.wait_for(first, 1)).time == 11.0
    for i in range(20, 25):  # a slow subscriber loses its oldest
        hub.publish(flow(i, ep=2))
    assert [(await anext(only_ep2)).time for _ in range(2)] == [23.0, 24.0]
    assert hub.lost == 3
    await only_ep2.aclose()
    assert FlowFilter(verdicts=frozenset({1})).matches(flow(1)) is False
    assert FlowFilter(drop_reasons=frozenset({130}), port=80, protocol=6).matches(flow(1))
