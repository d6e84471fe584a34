"""The lb's shortcuts on its bulk path: a record it wrote comes back from
the watch as the record it wrote (not parsed again), and a watch message is
built once for every watcher."""

from __future__ import annotations

import pytest

from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.common.etcd import KeyValue
from flagella.common.sync import Change
from flagella.lb.model import (
    Affinity,
    Algorithm,
    Backend,
    BackendState,
    Frontend,
    Protocol,
    ServiceRecord,
    ServiceType,
    Source,
)
from flagella.lb.servicer import EventCache, ServiceEvents
from flagella.lb.store import ServiceCodec, service_key

RECORDS = [
    ServiceRecord(
        name="ns/web",
        namespace="ns",
        id=7,
        rev_nat_id=9,
        frontend=Frontend("10.96.0.1", 80, Protocol.TCP),
        type=ServiceType.NODE_PORT,
        node_port=30080,
        backends=(
            Backend(64, "10.0.0.1", 8080),
            Backend(65, "10.0.0.2", 8080, 5, BackendState.TERMINATING, "n1"),
        ),
        algorithm=Algorithm.MAGLEV,
        maglev_table_size=251,
        affinity=Affinity(60),
        source_ranges=("10.0.0.0/8",),
        source=Source.KUBERNETES,
        backend_blocks=(1,),
        labels=(("app", "web"), ("tier", "a")),
        external=("192.0.2.1",),
    ),
    ServiceRecord(
        name="plain",
        namespace="",
        id=8,
        rev_nat_id=8,
        frontend=Frontend("fd00::1", 53, Protocol.UDP),
        type=ServiceType.CLUSTER_IP,
        node_port=0,
        backends=(),
        algorithm=Algorithm.RANDOM,
        maglev_table_size=16381,
        affinity=None,
        source_ranges=(),
        source=Source.API,
    ),
]


def kv(record: ServiceRecord, value: bytes, revision: int) -> KeyValue:
    return KeyValue(
        key=service_key(record.id),
        value=value,
        create_revision=revision,
        mod_revision=revision,
        version=1,
        lease=0,
    )


@pytest.mark.parametrize("record", RECORDS)
def test_an_expected_record_is_the_record_its_value_parses_to(record: ServiceRecord) -> None:
    codec = ServiceCodec()
    value = record.to_json()
    parsed = codec.decode(record.id, kv(record, value, 42))
    codec.expect(value, record)
    taken = codec.decode(record.id, kv(record, value, 42))
    assert taken is not None
    assert parsed is not None
    assert taken == parsed
    assert taken.__dict__ == parsed.__dict__  # the revision too (not compared by ==)
    assert taken.revision == 42
    assert record.revision == 0  # the expected record itself is not changed
    # Taken once: the same value written again is parsed.
    again = codec.decode(record.id, kv(record, value, 43))
    assert again is not None
    assert again.revision == 43


def test_expected_records_are_bounded_and_keyed_by_their_bytes() -> None:
    codec = ServiceCodec(expected_max=2)
    a, b = RECORDS
    codec.expect(b"stale", a)  # a write that failed: pushed out later
    codec.expect(a.to_json(), a)
    codec.expect(b.to_json(), b)
    assert len(codec._expected) == 2
    assert b"stale" not in codec._expected
    # Another service's key with those bytes: parsed, not taken.
    other = kv(b, a.to_json(), 5)
    assert codec.decode(b.id, other) is not None
    assert codec.decode(b.id, other) == a


class Tables:
    """watch_item's service, for ServiceEvents."""

    def __init__(self) -> None:
        self.calls = 0

    async def watch_item(
        self, change: Change[int, ServiceRecord], *, include_tables: bool
    ) -> object:
        from flagella.lb.service import WatchItem

        self.calls += 1
        table = (
            [64] * 251 if include_tables and change.record.algorithm is Algorithm.MAGLEV else None
        )
        return WatchItem(change.revision, change.record, table=table)


async def test_watch_messages_are_built_once_for_every_watcher() -> None:
    cache = EventCache()
    svc = Tables()
    maglev, plain = (r.with_revision(10 + i) for i, r in enumerate(RECORDS))
    with_tables = ServiceEvents(svc, include_tables=True, cache=cache)  # type: ignore[arg-type]
    without = ServiceEvents(svc, include_tables=False, cache=cache)  # type: ignore[arg-type]
    first = await with_tables.upsert(Change(plain.id, plain, None, 11))
    assert await without.upsert(Change(plain.id, plain, None, 11)) is first
    assert svc.calls == 1  # no table for a random service: one message
    m1 = await with_tables.upsert(Change(maglev.id, maglev, None, 10))
    m2 = await without.upsert(Change(maglev.id, maglev, None, 10))
    assert m1.HasField("maglev_table")
    assert not m2.HasField("maglev_table")
    assert svc.calls == 3
    # What the watcher held before is part of what the message says.
    held = maglev.with_revision(4)
    m3 = await without.upsert(Change(maglev.id, maglev, held, 10))
    assert m3 is not m2
    assert m3.kind == pb.ServiceEvent.KIND_UPSERT
    assert len(cache) == 4
    # Bounded by bytes: the oldest go first (the table's message is large).
    cache.max_bytes = cache.bytes - 1
    cache.put((0, 0, 0, False), pb.ServiceEvent(kind=pb.ServiceEvent.KIND_UPSERT))
    assert await without.upsert(Change(plain.id, plain, None, 11)) is not first
    assert cache.bytes <= cache.max_bytes
    assert cache.bytes == sum(size for _, size in cache._messages.values())
