"""The FQDN cache's expiry on this node: an entry past its expiry (lookup +
TTL, at least --tofqdns-min-ttl) is deleted through DeleteFQDNCache once no
live connection of the node uses one of its addresses (the conntrack map);
the policy service then takes the addresses' identities away (its GC)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cached:
    endpoint: str
    name: str
    ips: tuple[str, ...]
    expires: float  # Unix time


def due(
    entries: Iterable[Cached], now: float, in_use: set[str]
) -> tuple[list[Cached], list[Cached]]:
    """(expired and unused: to delete, expired but in use: kept)."""
    gone: list[Cached] = []
    kept: list[Cached] = []
    for e in entries:
        if e.expires > now:
            continue
        (kept if any(ip in in_use for ip in e.ips) else gone).append(e)
    return gone, kept


class Expiry:
    def __init__(
        self,
        policy: policy_pb2_grpc.PolicyServiceAsyncStub,
        node: str,
        live_peers: Callable[[], Awaitable[set[str]]],
        forget: Callable[[int, str], None],
    ) -> None:
        self.policy = policy
        self.node = node
        self.live_peers = live_peers
        self.forget = forget
        self._kept: set[tuple[str, str]] = set()
        self.deleted = 0

    async def run(self, interval: float) -> None:
        while True:
            # Jittered, so that the nodes of a cluster do not list the
            # cache all at once.
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            await self.once()

    async def once(self) -> None:
        listed = await self.policy.ListFQDNCache(
            policy_pb2.ListFQDNCacheRequest(node=self.node), timeout=10.0
        )
        entries = [
            Cached(e.endpoint, e.name, tuple(e.ips), e.expires.ToNanoseconds() / 1e9)
            for e in listed.entries
        ]
        now = time.time()
        if not any(e.expires <= now for e in entries):
            return
        gone, kept = due(entries, now, await self.live_peers())
        for e in kept:
            if (e.endpoint, e.name) not in self._kept:
                self._kept.add((e.endpoint, e.name))
                log.info(
                    "FQDN entry expired, kept: a connection uses it",
                    extra={"endpoint": e.endpoint, "fqdn": e.name},
                )
        for e in gone:
            await self.policy.DeleteFQDNCache(
                policy_pb2.DeleteFQDNCacheRequest(
                    node=self.node, endpoint=e.endpoint, match_pattern=e.name
                ),
                timeout=10.0,
            )
            self._kept.discard((e.endpoint, e.name))
            if e.endpoint.isdigit():
                self.forget(int(e.endpoint), e.name)
            self.deleted += 1
            log.info("FQDN entry expired", extra={"endpoint": e.endpoint, "fqdn": e.name})
