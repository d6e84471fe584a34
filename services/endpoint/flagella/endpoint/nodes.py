"""A mirror of ipam's node registry (datapath address, host IP, pod CIDRs),
so that an ADD does not ask ipam for its node each time.

The mirror is a table fed by a StreamSource over ipam's WatchNodes
(IpamPeer.follow_nodes): a snapshot swapped in whole at its SYNCED, then
each UPSERT and DELETE as it comes; after a broken stream it resumes from
the last SYNCED revision (ipam answers with what changed since, or with a
fresh snapshot). It answers only while that stream is live and synced;
before, and from the moment the stream breaks until it is synced again, it
answers nothing and callers ask ipam directly. So an entry is never older
than the stream's latest event for its node, and a node whose datapath
moved or whose CIDRs changed is seen as soon as ipam's event is.
"""

from __future__ import annotations

from flagella.common.sync import Table
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.endpoint.service import NodeInfo


class NodeMirror:
    def __init__(self) -> None:
        self.table: Table[str, NodeInfo] = Table("ipam nodes", log_size=LOCAL_LOG_SIZE)
        # Counters, for health and tests.
        self.hits = 0
        self.misses = 0

    @property
    def live(self) -> bool:
        return self.table.live

    def get(self, name: str) -> NodeInfo | None:
        """The node as the stream last said, or None: not live, or a node
        the registry does not have (the caller asks ipam, which says so)."""
        node = self.table.get(name) if self.table.live else None
        if node is None:
            self.misses += 1
        else:
            self.hits += 1
        return node
