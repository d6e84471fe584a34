"""Flow events (drops, policy verdicts) fanned out to ObserveFlows callers:
a ring of recent flows plus live subscribers with their filters. A slow
subscriber loses its oldest events, never blocks the datapath's reader."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FlowRecord:
    time: float
    type: int  # datapath.v1.FlowType
    verdict: int  # datapath.v1.FlowVerdict
    drop_reason: int  # datapath.v1.DropReason (the datapath's own codes)
    direction: int  # datapath.v1.FlowDirection
    src_ip: str
    dst_ip: str
    src_port: int
    dst_port: int
    protocol: int
    src_identity: int
    dst_identity: int
    endpoint_id: int
    ifindex: int
    tcp_flags: int = 0
    icmp_type: int = 0
    # AUDIT and policy drops: the rules enforcing the endpoint's policy in
    # the flow's direction (the rule set that denies it).
    denied_by: tuple[str, ...] = ()
    # FLOW_TYPE_L7: the DNS proxy's record.
    dns: DnsRecord | None = None


@dataclass(frozen=True)
class DnsRecord:
    query: str
    ips: tuple[str, ...] = ()
    ttl: int = 0
    rcode: int = 0
    qtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlowFilter:
    """Empty fields match everything."""

    verdicts: frozenset[int] = field(default_factory=frozenset)
    drop_reasons: frozenset[int] = field(default_factory=frozenset)
    endpoint_ids: frozenset[int] = field(default_factory=frozenset)
    identities: frozenset[int] = field(default_factory=frozenset)
    ip: str = ""
    port: int = 0
    protocol: int = 0
    directions: frozenset[int] = field(default_factory=frozenset)
    since: float = 0.0  # Unix time; 0: any

    def matches(self, f: FlowRecord) -> bool:
        return (
            (not self.verdicts or f.verdict in self.verdicts)
            and (not self.directions or f.direction in self.directions)
            and f.time >= self.since
            and (not self.drop_reasons or f.drop_reason in self.drop_reasons)
            and (not self.endpoint_ids or f.endpoint_id in self.endpoint_ids)
            and (
                not self.identities
                or f.src_identity in self.identities
                or f.dst_identity in self.identities
            )
            and (not self.ip or self.ip in (f.src_ip, f.dst_ip))
            and (not self.port or self.port in (f.src_port, f.dst_port))
            and (not self.protocol or f.protocol == self.protocol)
        )


class FlowHub:
    def __init__(self, capacity: int = 4096, subscriber_queue: int = 1024) -> None:
        self._ring: collections.deque[FlowRecord] = collections.deque(maxlen=capacity)
        self._subscribers: list[tuple[FlowFilter, asyncio.Queue[FlowRecord]]] = []
        self.subscriber_queue = subscriber_queue
        self.published = 0
        self.lost = 0

    def publish(self, flow: FlowRecord) -> None:
        self.published += 1
        self._ring.append(flow)
        for flt, queue in self._subscribers:
            if not flt.matches(flow):
                continue
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                self.lost += 1
            queue.put_nowait(flow)

    def recent(self, flt: FlowFilter, last: int) -> list[FlowRecord]:
        if last <= 0:
            return []
        matching = [f for f in self._ring if flt.matches(f)]
        return matching[-last:]

    async def follow(self, flt: FlowFilter) -> AsyncIterator[FlowRecord]:
        queue: asyncio.Queue[FlowRecord] = asyncio.Queue(self.subscriber_queue)
        entry = (flt, queue)
        self._subscribers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.remove(entry)
