"""MessageCache: messages shared by watch streams, bounded by bytes and, with
a slot, to the newest message of each record."""

from __future__ import annotations

from flagella.api.ipam.v1 import ipam_pb2 as pb
from flagella.common.sync import MessageCache


def event(name: str, revision: int) -> pb.NodeEvent:
    return pb.NodeEvent(kind=pb.NodeEvent.KIND_UPSERT, revision=revision, node=pb.Node(name=name))


def test_a_slot_keeps_only_its_newest_message() -> None:
    cache: MessageCache[tuple[str, int], pb.NodeEvent] = MessageCache(slot=lambda key: key[0])
    for revision in range(1, 1001):
        cache.put(("n1", revision), event("n1", revision))
        cache.put(("n2", revision), event("n2", revision))
    # Two records changed 1,000 times each: two messages, not 2,000.
    assert len(cache) == 2
    assert cache.get(("n1", 1000)) == event("n1", 1000)
    assert cache.get(("n1", 999)) is None
    assert cache.bytes == event("n1", 1000).ByteSize() + event("n2", 1000).ByteSize()


def test_without_a_slot_the_byte_bound_evicts_the_oldest() -> None:
    size = event("n1", 1).ByteSize()
    cache: MessageCache[tuple[str, int], pb.NodeEvent] = MessageCache(max_bytes=3 * size)
    for revision in range(1, 6):
        cache.put(("n1", revision), event("n1", revision))
    assert len(cache) == 3
    assert cache.get(("n1", 2)) is None
    assert cache.get(("n1", 5)) is not None
    assert cache.bytes <= 3 * size


def test_the_byte_bound_and_slots_together_stay_consistent() -> None:
    size = event("a", 1).ByteSize()
    cache: MessageCache[tuple[str, int], pb.NodeEvent] = MessageCache(
        max_bytes=2 * size, slot=lambda key: key[0]
    )
    cache.put(("a", 1), event("a", 1))
    cache.put(("b", 1), event("b", 1))
    cache.put(("c", 1), event("c", 1))  # evicts a by bytes
    assert cache.get(("a", 1)) is None
    cache.put(("a", 2), event("a", 2))  # evicts b by bytes; a's slot is free
    cache.put(("c", 2), event("c", 2))  # replaces c's older message
    assert len(cache) == 2
    a, c = cache.get(("a", 2)), cache.get(("c", 2))
    assert a is not None
    assert c is not None
    assert cache.bytes == a.ByteSize() + c.ByteSize()
