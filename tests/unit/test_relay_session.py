"""The relay's follow streams against fake datapaths (the logic alone; the
real processes are in tests/integration/test_cli.py): both nodes' flows in
time order with their node's CONNECTED first; a broken stream reported and
resumed from just after its last flow (none twice); a hung node reported;
a full node buffer
dropping its oldest, reported as lost; non-follow's last N overall."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from flagella.api.datapath.v1 import datapath_pb2
from flagella.common.errors import Unavailable
from flagella.common.sync import Table
from flagella.relay.service import Lost, NodeInfo, NodeStatus, Relay, Settings

N1, N2 = NodeInfo("n1", "unix:/n1"), NodeInfo("n2", "unix:/n2")


def flow(node: str, t: int) -> datapath_pb2.Flow:
    f = datapath_pb2.Flow(node=node)
    f.time.FromNanoseconds(t)
    return f


class FakeDatapaths:
    """Each node's ring of flows; live ones through a queue; a node can be
    made to fail (its stream breaks, its checks fail)."""

    def __init__(self) -> None:
        self.ring: dict[str, list[datapath_pb2.Flow]] = {"n1": [], "n2": []}
        self.live: dict[str, asyncio.Queue[datapath_pb2.Flow | None]] = {
            "n1": asyncio.Queue(),
            "n2": asyncio.Queue(),
        }
        self.down: set[str] = set()
        # Cleared: the node's checks do not answer (it hangs).
        self.answering = {"n1": asyncio.Event(), "n2": asyncio.Event()}
        for event in self.answering.values():
            event.set()
        self.requests: list[tuple[str, datapath_pb2.ObserveFlowsRequest]] = []

    def send(self, node: str, t: int) -> None:
        f = flow(node, t)
        self.ring[node].append(f)
        self.live[node].put_nowait(f)

    async def check(self, node: NodeInfo, timeout: float) -> None:
        await self.answering[node.name].wait()
        if node.name in self.down:
            raise Unavailable(f"{node.name} down")

    async def flows(
        self, node: NodeInfo, request: datapath_pb2.ObserveFlowsRequest, timeout: float | None
    ) -> AsyncIterator[datapath_pb2.Flow]:
        self.requests.append((node.name, request.__deepcopy__()))
        if node.name in self.down:
            raise Unavailable(f"{node.name} down")
        since = request.since.ToNanoseconds() if request.HasField("since") else 0
        kept = [f for f in self.ring[node.name] if f.time.ToNanoseconds() >= since]
        for f in kept[-request.last :] if request.last else []:
            yield f
        if not request.follow:
            return
        queue = self.live[node.name]
        while not queue.empty():  # what the ring already gave
            queue.get_nowait()
        while True:
            live = await queue.get()
            if live is None:
                raise Unavailable(f"{node.name}: stream broke")
            yield live


async def next_event(events: AsyncIterator[object]) -> object:
    return await asyncio.wait_for(anext(events), 5)


async def test_follow_merges_reports_resumes_and_counts_lost() -> None:
    nodes: Table[str, NodeInfo] = Table("nodes")
    nodes.replace([("n1", N1, 1), ("n2", N2, 1)], 1)
    nodes.set_live(True)
    dp = FakeDatapaths()
    settings = Settings(
        node_buffer_size=2,
        sort_buffer_max_len=100,
        sort_buffer_drain_timeout=0.05,
        node_timeout=0.1,
        liveness_interval=0.02,
        liveness_timeout=0.05,
        backoff_initial=0.01,
        backoff_max=0.02,
    )
    relay = Relay(nodes, dp, settings)
    for node, t in (("n1", 10), ("n2", 20), ("n1", 30)):
        dp.send(node, t)
    request = datapath_pb2.ObserveFlowsRequest(last=2**32 - 1, follow=True)
    events = relay.observe(request, ())
    first = [await next_event(events) for _ in range(5)]
    statuses = {e for e in first if isinstance(e, NodeStatus)}
    assert statuses == {NodeStatus("n1", True), NodeStatus("n2", True)}
    flows = [e for e in first if isinstance(e, datapath_pb2.Flow)]
    assert [(f.node, f.time.ToNanoseconds()) for f in flows] == [
        ("n1", 10), ("n2", 20), ("n1", 30)
    ]  # fmt: skip

    # n1's stream breaks: reported; it comes back, resumed after 30.
    dp.down.add("n1")
    dp.live["n1"].put_nowait(None)
    assert await next_event(events) == NodeStatus("n1", False, "n1: stream broke")
    dp.down.discard("n1")
    assert await next_event(events) == NodeStatus("n1", True)
    dp.send("n1", 40)
    got = await next_event(events)
    assert isinstance(got, datapath_pb2.Flow)
    assert got.time.ToNanoseconds() == 40  # 10 and 30 not again
    resumed = [r for n, r in dp.requests if n == "n1"][-1]
    assert resumed.since.ToNanoseconds() == 31

    # n1 hangs (its stream open, no answer): reported, then back.
    dp.answering["n1"].clear()
    assert await next_event(events) == NodeStatus(
        "n1", False, "no answer to a health check within 0.05s"
    )
    dp.answering["n1"].set()
    assert await next_event(events) == NodeStatus("n1", True)

    # A reader that does not read: n2's buffer keeps its newest 2 of 5.
    for t in range(50, 55):
        dp.send("n2", t)
    await asyncio.sleep(0.1)
    assert await next_event(events) == Lost("n2", 3)
    rest = [await next_event(events) for _ in range(2)]
    assert [f.time.ToNanoseconds() for f in rest if isinstance(f, datapath_pb2.Flow)] == [53, 54]
    assert isinstance(events, AsyncGenerator)
    await events.aclose()
    assert relay.views["n2"].flows_seen == 6
    # What its metrics read: the flows passed on, those lost per node.
    assert (relay.forwarded, relay.lost) == (6, {"n2": 3})

    # Without follow: each node's last 2, merged, the last 2 overall; a
    # node that does not answer is a status event.
    dp.down.add("n2")
    dp.ring["n2"].clear()
    buffered = [e async for e in relay.observe(datapath_pb2.ObserveFlowsRequest(last=2), ("n*",))]
    assert buffered[0] == NodeStatus("n2", False, "n2 down")
    assert [f.time.ToNanoseconds() for f in buffered[1:] if isinstance(f, datapath_pb2.Flow)] == [
        30, 40
    ]  # fmt: skip
    assert len(buffered) == 3
