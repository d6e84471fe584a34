"""The relay's merging, pure: a bounded buffer per node and a sort window.

Each node's stream fills its own NodeBuffer; when the caller reads more
slowly than the nodes send, a full buffer drops its oldest flow and counts
it (reported as a LostEvent), so one slow reader costs bounded memory and
one busy node cannot starve the others. The SortWindow holds flows from
every node and releases them oldest first: one when it holds more than
max_len, all of them when no flow came for the drain timeout (as Hubble
Relay's --sort-buffer-max-len and --sort-buffer-drain-timeout).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class NodeBuffer(Generic[T]):
    """A FIFO of at most size items; a put on a full one drops the oldest."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a node buffer holds at least one flow")
        self._items: deque[T] = deque(maxlen=size)
        self.lost = 0  # dropped since the last take_lost()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        if len(self._items) == self._items.maxlen:
            self.lost += 1
        self._items.append(item)

    def take(self) -> list[T]:
        """Every item held, oldest first; the buffer is then empty."""
        items = list(self._items)
        self._items.clear()
        return items

    def take_lost(self) -> int:
        lost, self.lost = self.lost, 0
        return lost


@dataclass(order=True)
class _Entry(Generic[T]):
    time_ns: int
    seq: int  # equal times keep their arrival order
    item: T = field(compare=False)


class SortWindow(Generic[T]):
    """Items by time (nanoseconds), oldest first, within a window of max_len."""

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError("the sort window holds at least one flow")
        self.max_len = max_len
        self._heap: list[_Entry[T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time_ns: int, item: T) -> list[T]:
        """Adds item; returns what the window releases (oldest first): the
        oldest item once it holds more than max_len."""
        heapq.heappush(self._heap, _Entry(time_ns, next(self._seq), item))
        out = []
        while len(self._heap) > self.max_len:
            out.append(heapq.heappop(self._heap).item)
        return out

    def drain(self) -> list[T]:
        """Everything held, oldest first (no flow came for the drain timeout)."""
        return [heapq.heappop(self._heap).item for _ in range(len(self._heap))]


def last_n(batches: Iterable[Iterable[tuple[int, T]]], n: int) -> list[T]:
    """The last n items by time of several nodes' (time_ns, item) lists,
    oldest first (n = 0: all)."""
    # sorted() is stable: flows of equal time keep their node's order.
    merged = sorted((e for batch in batches for e in batch), key=lambda e: e[0])
    items = [item for _, item in merged]
    return items[-n:] if n else items
