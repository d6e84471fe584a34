"""A mirror of ipam's node registry (datapath address, host IP, pod CIDRs),
so that an ADD does not ask ipam for its node each time.

The mirror is filled only from a WatchNodes stream, in the stream's order:
RESET (forget everything), UPSERT and DELETE of single nodes, SYNCED once the
snapshot is complete. It answers only while that stream is live and synced;
before, and from the moment the stream breaks until a fresh snapshot is
synced again, it answers nothing and callers ask ipam directly. So an entry
is never older than the stream's latest event for its node, and a node whose
datapath moved or whose CIDRs changed is seen as soon as ipam's event is.
"""

from __future__ import annotations

from flagella.endpoint.service import NodeInfo


class NodeMirror:
    def __init__(self) -> None:
        self._nodes: dict[str, NodeInfo] = {}
        self._live = False
        # Counters, for health and tests.
        self.hits = 0
        self.misses = 0

    @property
    def live(self) -> bool:
        return self._live

    def get(self, name: str) -> NodeInfo | None:
        """The node as the stream last said, or None: not live, or a node
        the registry does not have (the caller asks ipam, which says so)."""
        node = self._nodes.get(name) if self._live else None
        if node is None:
            self.misses += 1
        else:
            self.hits += 1
        return node

    # --- the stream ---

    def reset(self) -> None:
        self._nodes.clear()
        self._live = False

    def upsert(self, node: NodeInfo) -> None:
        self._nodes[node.name] = node

    def delete(self, name: str) -> None:
        self._nodes.pop(name, None)

    def synced(self) -> None:
        self._live = True

    def broken(self) -> None:
        """The stream ended or failed: events may be missed from now on."""
        self.reset()
