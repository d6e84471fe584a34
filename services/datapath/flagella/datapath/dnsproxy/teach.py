"""Teaching the policy service an answer (UpsertFQDNCache, on this node's
behalf) and waiting until this node applied it: its ipcache and the
asking endpoint's policy at the answer's revision."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.datapath.dnsproxy.learn import Learned

log = logging.getLogger(__name__)

MAX_ENTRIES = 100  # per UpsertFQDNCache

# endpoint id, revision, timeout -> whether it was applied in time
WaitApplied = Callable[[int, int, float], Awaitable[bool]]


class Teacher:
    def __init__(
        self,
        policy: policy_pb2_grpc.PolicyServiceAsyncStub,
        node: str,
        wait_applied: WaitApplied,
        max_delay: float,
    ) -> None:
        self.policy = policy
        self.node = node
        self.wait_applied = wait_applied
        self.max_delay = max_delay
        self.late = 0  # answers released at max_delay, not applied yet

    async def __call__(self, endpoint: int, items: list[Learned]) -> None:
        request = policy_pb2.UpsertFQDNCacheRequest(
            node=self.node,
            entries=[
                policy_pb2.FQDNCacheEntry(
                    endpoint=str(endpoint), name=i.name, ips=list(i.ips), ttl=i.ttl
                )
                for i in items[:MAX_ENTRIES]
            ],
        )
        reply = await self.policy.UpsertFQDNCache(request, timeout=5.0)
        if not reply.selected:
            return  # no policy depends on these addresses: nothing to wait for
        if not await self.wait_applied(endpoint, reply.revision, self.max_delay):
            # A name no toFQDNs selector matches changes no policy: nothing
            # comes to wait for (until the streams' next heartbeat).
            self.late += 1
            log.debug(
                "DNS answer released before its revision was applied",
                extra={"endpoint": endpoint, "revision": reply.revision},
            )
