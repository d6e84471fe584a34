"""What this process wrote to its pinned maps (GetMapEvents, Cilium's map
events): per map, a ring of its last N writes.

BpfMap records every update and delete it makes, batches included, here
(the one place the datapath's writers go through). A write is kept as one
packed bytes object (a 20-byte header, the raw key and value), decoded only
when read: 61 bytes with Python's overhead plus the key and value, never a
copy of a map. The
rings fill on the map-writer thread and are read on the event loop; a
follower is woken through the loop it gave (call_soon_threadsafe), once
per write or batch, and only while someone follows.
"""

from __future__ import annotations

import collections
import itertools
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

UPDATE = 1
DELETE = 2
# Writes kept per map unless told (--map-event-history).
DEFAULT_MAP_EVENT_HISTORY = 512

# seq, time (ns since the epoch), action, ok, errno
_HEAD = struct.Struct("<QqBBH")


@dataclass(frozen=True)
class MapEvent:
    map: str
    seq: int
    time_ns: int
    action: int  # UPDATE or DELETE
    ok: bool
    errno: int  # not ok: why; ENOENT on an ok delete: the key was absent
    key: bytes
    value: bytes  # b"" for a delete

    @property
    def error(self) -> str:
        return os.strerror(self.errno) if self.errno else ""


class EventRing:
    """One map's history: its last `capacity` writes, oldest first."""

    __slots__ = ("_listeners", "_ring", "_seq", "key_size", "name")

    def __init__(
        self,
        name: str,
        key_size: int,
        capacity: int,
        seq: Callable[[], int],
        listeners: list[Callable[[], None]],
    ) -> None:
        self.name = name
        self.key_size = key_size
        self._ring: collections.deque[bytes] = collections.deque(maxlen=capacity)
        self._seq = seq
        self._listeners = listeners

    def one(
        self, action: int, key: bytes, value: bytes = b"", *, ok: bool = True, err: int = 0
    ) -> None:
        """One write (the common case, kept short: it is on every write)."""
        self._ring.append(
            _HEAD.pack(self._seq(), time.time_ns(), action, ok, min(err, 0xFFFF)) + key + value
        )
        for wake in self._listeners:
            wake()

    def record(
        self,
        action: int,
        keys: Sequence[bytes],
        values: Sequence[bytes] = (),
        *,
        ok: bool = True,
        err: int = 0,
    ) -> None:
        """One event per key, all at one time (a batch; values: one per
        key, or none for deletes)."""
        now = time.time_ns()
        pack = _HEAD.pack
        seq = self._seq
        append = self._ring.append
        err = min(err, 0xFFFF)
        if values:
            for k, v in zip(keys, values, strict=True):
                append(pack(seq(), now, action, ok, err) + k + v)
        else:
            for k in keys:
                append(pack(seq(), now, action, ok, err) + k)
        for wake in self._listeners:
            wake()

    def __len__(self) -> int:
        return len(self._ring)

    def after(self, seq: int) -> list[MapEvent]:
        """The events held with a sequence number above seq, oldest first."""
        out = []
        size = _HEAD.size
        ks = self.key_size
        for raw in list(self._ring):  # a copy taken under the GIL: the writer goes on
            n, t, action, ok, err = _HEAD.unpack_from(raw)
            if n > seq:
                out.append(
                    MapEvent(
                        self.name,
                        n,
                        t,
                        action,
                        bool(ok),
                        err,
                        raw[size : size + ks],
                        raw[size + ks :],
                    )
                )
        return out


class MapEventLog:
    """The rings of every map of one Datapath, with one sequence over all
    (so writes to different maps can be put in order) and the followers'
    wake-up calls."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must not be negative")
        self.capacity = capacity
        self._counter = itertools.count(1)
        self._listeners: dict[str, list[Callable[[], None]]] = {}
        self.rings: dict[str, EventRing] = {}

    def ring(self, name: str, key_size: int) -> EventRing | None:
        """The ring of map `name` (None when the history is off: capacity 0)."""
        if not self.capacity:
            return None
        listeners = self._listeners.setdefault(name, [])
        ring = EventRing(name, key_size, self.capacity, self._counter.__next__, listeners)
        self.rings[name] = ring
        return ring

    def listen(self, name: str, wake: Callable[[], None]) -> Callable[[], None]:
        """Calls wake() (on the writer's thread) after each write to map
        `name`; returns the function that stops it."""
        listeners = self._listeners.setdefault(name, [])
        listeners.append(wake)
        return lambda: listeners.remove(wake)
