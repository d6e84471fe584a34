"""The relay: every node's flows merged into one stream (no gRPC here).

Nodes come from a table mirroring ipam's node registry (peers.py fills
it). A request opens one flow stream per matching node, each into its own
bounded buffer (merge.NodeBuffer), merged through a sort window; a stream
that breaks is reopened after a backoff, from just after the last flow it
sent (`since`), so nothing is sent twice. A node's state changes come as
NodeStatus events, flows dropped from a full buffer as Lost events.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from flagella.api.datapath.v1 import datapath_pb2
from flagella.common.backoff import Backoff
from flagella.common.errors import FlagellaError, NotFound, Unavailable
from flagella.common.sync import Table
from flagella.common.tasks import TaskGroup
from flagella.relay.merge import NodeBuffer, SortWindow, last_n

log = logging.getLogger(__name__)

ALL = 2**32 - 1  # a request's `last`: every buffered flow
REGISTRY_WAIT = 5.0  # seconds a request waits for the node registry's first sync


@dataclass(frozen=True)
class NodeInfo:
    """A node as the registry says: its datapath's address."""

    name: str
    address: str


@dataclass(frozen=True)
class NodeStatus:
    node: str
    connected: bool
    message: str = ""


@dataclass(frozen=True)
class Lost:
    node: str
    count: int


Event = datapath_pb2.Flow | NodeStatus | Lost


@dataclass
class NodeView:
    """The relay's view of a node (GetNodes): None: not reached yet."""

    name: str
    address: str
    connected: bool | None = None
    last_error: str = ""
    flows_seen: int = 0


class FlowSource(Protocol):
    """The nodes' datapaths (peers.py): errors are FlagellaErrors."""

    async def check(self, node: NodeInfo, timeout: float) -> None:
        """Return when the node's datapath answers; raise Unavailable."""

    def flows(
        self, node: NodeInfo, request: datapath_pb2.ObserveFlowsRequest, timeout: float | None
    ) -> AsyncIterator[datapath_pb2.Flow]:
        """The node's ObserveFlows stream."""


@dataclass(frozen=True)
class Settings:
    node_buffer_size: int = 2048
    sort_buffer_max_len: int = 1000
    sort_buffer_drain_timeout: float = 0.1
    # Seconds to wait for a node's answer (a check, a non-follow request).
    node_timeout: float = 5.0
    # While a node's stream is open: how often its health is checked, and
    # how long it gets to answer (a hung node is reported after at most
    # their sum).
    liveness_interval: float = 2.0
    liveness_timeout: float = 2.0
    # Reconnecting a node's broken stream.
    backoff_initial: float = 0.2
    backoff_max: float = 5.0


def _ns(f: datapath_pb2.Flow) -> int:
    return int(f.time.ToNanoseconds())


class Relay:
    def __init__(
        self,
        nodes: Table[str, NodeInfo],
        source: FlowSource,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nodes = nodes
        self.source = source
        self.settings = settings
        self.clock = clock
        self.views: dict[str, NodeView] = {}
        # What the relay passed on (its metrics): flows to every reader,
        # flows dropped from each node's full buffer.
        self.forwarded = 0
        self.lost: dict[str, int] = {}

    # --- the nodes ---

    def view(self, node: NodeInfo) -> NodeView:
        v = self.views.get(node.name)
        if v is None or v.address != node.address:
            v = self.views[node.name] = NodeView(node.name, node.address)
        return v

    def node_views(self) -> list[NodeView]:
        """Every node the registry has, as the relay last saw it."""
        return [self.view(n) for _, n in sorted(self.nodes.items())]

    def mark(self, node: NodeInfo, connected: bool, error: str = "") -> bool:
        """Records the node's state; True when it changed."""
        v = self.view(node)
        changed = v.connected != connected
        v.connected = connected
        if error:
            v.last_error = error
        return changed

    async def probe(self, interval: float) -> None:
        """Checks every node every interval (GetNodes' state between
        requests), until cancelled."""
        while True:
            for _, node in list(self.nodes.items()):
                try:
                    await self.source.check(node, self.settings.node_timeout)
                    self.mark(node, True)
                except FlagellaError as exc:
                    self.mark(node, False, exc.details)
            await asyncio.sleep(interval)

    async def _matching(self, globs: tuple[str, ...]) -> list[NodeInfo]:
        try:
            await self.nodes.wait_initialized(REGISTRY_WAIT)
        except TimeoutError:
            raise Unavailable("the node registry (ipam) has not answered yet") from None
        nodes = [n for _, n in sorted(self.nodes.items()) if _matches(n.name, globs)]
        if globs and not nodes:
            raise NotFound(f"no node matches {', '.join(globs)}", field="nodes")
        return nodes

    # --- observing ---

    async def observe(
        self, request: datapath_pb2.ObserveFlowsRequest, globs: tuple[str, ...]
    ) -> AsyncIterator[Event]:
        """Every matching node's flows, merged, with node status and lost
        events: the one stream the gRPC API and the web page both read."""
        # aclosing: a reader that leaves ends the node streams at once.
        async with contextlib.aclosing(self._observe(request, globs)) as events:
            async for event in events:
                if isinstance(event, Lost):
                    self.lost[event.node] = self.lost.get(event.node, 0) + event.count
                elif not isinstance(event, NodeStatus):
                    self.forwarded += 1
                yield event

    async def _observe(
        self, request: datapath_pb2.ObserveFlowsRequest, globs: tuple[str, ...]
    ) -> AsyncGenerator[Event]:
        nodes = await self._matching(globs)
        if not request.follow:
            async for event in self._buffered(request, nodes):
                yield event
            return
        async with TaskGroup("observe") as tasks:
            session = _Session(self, request, globs, tasks)
            async for event in session.run():
                yield event

    async def _buffered(
        self, request: datapath_pb2.ObserveFlowsRequest, nodes: list[NodeInfo]
    ) -> AsyncIterator[Event]:
        """Each node's last N, merged; the last N overall."""

        async def one(node: NodeInfo) -> list[tuple[int, datapath_pb2.Flow]] | NodeStatus:
            try:
                async with asyncio.timeout(self.settings.node_timeout):
                    got = [(_ns(f), f) async for f in self.source.flows(node, request, None)]
            except (FlagellaError, TimeoutError) as exc:
                error = getattr(exc, "details", "") or "no answer in time"
                self.mark(node, False, error)
                return NodeStatus(node.name, False, error)
            self.mark(node, True)
            self.view(node).flows_seen += len(got)
            return got

        results = await asyncio.gather(*(one(n) for n in nodes))
        for r in results:
            if isinstance(r, NodeStatus):
                yield r
        batches = [r for r in results if not isinstance(r, NodeStatus)]
        for f in last_n(batches, 0 if request.last >= ALL else request.last):
            yield f


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    return not globs or any(fnmatch.fnmatch(name, g) for g in globs)


class _Session:
    """One follow request: a stream per node into its buffer, merged."""

    def __init__(
        self,
        relay: Relay,
        request: datapath_pb2.ObserveFlowsRequest,
        globs: tuple[str, ...],
        tasks: TaskGroup,
    ) -> None:
        self.relay = relay
        self.request = request
        self.globs = globs
        self.tasks = tasks
        self.buffers: dict[str, NodeBuffer[datapath_pb2.Flow]] = {}
        self.followed: dict[str, tuple[NodeInfo, asyncio.Task[None]]] = {}
        self.statuses: list[NodeStatus] = []
        self.wake = asyncio.Event()

    def _sync_nodes(self) -> None:
        """Follows the registry: a stream for each new matching node; a
        node gone from it (or moved) is reported and its stream ended."""
        current = {n.name: n for _, n in self.relay.nodes.items() if _matches(n.name, self.globs)}
        for name, (node, task) in list(self.followed.items()):
            if current.get(name) != node:
                task.cancel()
                del self.followed[name]
                if name not in current:
                    self.statuses.append(NodeStatus(name, False, "left the node registry"))
        for name, node in current.items():
            if name not in self.followed:
                buf = self.buffers.setdefault(
                    name, NodeBuffer(self.relay.settings.node_buffer_size)
                )
                task = self.tasks.spawn(f"observe-{name}", self._follow(node, buf))
                self.followed[name] = (node, task)

    async def _follow(self, node: NodeInfo, buf: NodeBuffer[datapath_pb2.Flow]) -> None:
        relay, s = self.relay, self.relay.settings
        backoff = Backoff(s.backoff_initial, s.backoff_max)
        request = datapath_pb2.ObserveFlowsRequest()
        request.CopyFrom(self.request)
        reported: bool | None = None
        while True:
            error = await self._answers(node, s.node_timeout)
            if not error:
                if reported is not True:
                    relay.mark(node, True)
                    self._status(NodeStatus(node.name, True))
                    reported = True
                # The stream, and beside it a health check: a node that
                # hangs (no reset, no keepalive answer for a while) is
                # reported within seconds, not once TCP gives up.
                async with TaskGroup(f"follow-{node.name}") as group:
                    parts = {
                        group.spawn("flows", self._consume(node, buf, request, backoff)),
                        group.spawn("liveness", self._liveness(node)),
                    }
                    done, _ = await asyncio.wait(parts, return_when=asyncio.FIRST_COMPLETED)
                error = done.pop().result()
            relay.mark(node, False, error)
            if reported is not False:
                self._status(NodeStatus(node.name, False, error))
                reported = False
            await backoff.wait()

    async def _answers(self, node: NodeInfo, timeout: float) -> str:
        """ "" when the node's datapath answers a health check in time, else why not."""
        try:
            async with asyncio.timeout(timeout):
                await self.relay.source.check(node, timeout)
        except FlagellaError as exc:
            return exc.details
        except TimeoutError:
            return f"no answer to a health check within {timeout}s"
        return ""

    async def _consume(
        self,
        node: NodeInfo,
        buf: NodeBuffer[datapath_pb2.Flow],
        request: datapath_pb2.ObserveFlowsRequest,
        backoff: Backoff,
    ) -> str:
        """The node's flows into its buffer until the stream ends: why."""
        try:
            async for f in self.relay.source.flows(node, request, None):
                buf.put(f)
                self.relay.view(node).flows_seen += 1
                # A new stream resumes just after it, every flow buffered since.
                request.since.FromNanoseconds(_ns(f) + 1)
                request.last = ALL
                self.wake.set()
                backoff.reset()
        except FlagellaError as exc:
            return exc.details
        return "the node's stream ended"

    async def _liveness(self, node: NodeInfo) -> str:
        """Checks the node every liveness_interval; returns when it fails: why."""
        s = self.relay.settings
        while True:
            await asyncio.sleep(s.liveness_interval)
            error = await self._answers(node, s.liveness_timeout)
            if error:
                return error

    def _status(self, status: NodeStatus) -> None:
        self.statuses.append(status)
        self.wake.set()

    async def run(self) -> AsyncIterator[Event]:
        s = self.relay.settings
        window: SortWindow[datapath_pb2.Flow] = SortWindow(s.sort_buffer_max_len)
        held_since: float | None = None  # when the window's oldest arrival came
        revision = -1
        while True:
            if self.relay.nodes.revision != revision:
                revision = self.relay.nodes.revision
                self._sync_nodes()
            timeout = (
                1.0
                if held_since is None
                else max(0.0, held_since + s.sort_buffer_drain_timeout - self.relay.clock())
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            self.wake.clear()
            statuses, self.statuses = self.statuses, []
            for status in statuses:
                yield status
            for name, buf in self.buffers.items():
                lost = buf.take_lost()
                if lost:
                    yield Lost(name, lost)
                for f in buf.take():
                    if held_since is None:
                        held_since = self.relay.clock()
                    for out in window.push(_ns(f), f):
                        yield out
            if held_since is not None and (
                self.relay.clock() - held_since >= s.sort_buffer_drain_timeout
            ):
                for out in window.drain():
                    yield out
                held_since = None
