"""The PoolCache as the sink of an EtcdSource over pool/: a snapshot
rebuilds every pool, then each watch event is applied in order (an IP taken
and released within one watch response ends free, even when this replica
marked it used from its own write first), and reservations are tracked for
the expiry sweep."""

from __future__ import annotations

import ipaddress

from flagella.common.etcd import KeyValue
from flagella.ipam.model import Allocation, Family, Owner
from flagella.ipam.store import (
    PoolCache,
    PoolCodec,
    cidrs_key,
    encode_allocation,
    encode_cidrs,
    ip_key,
)

NODE = "n1"
NET = ipaddress.ip_network("10.3.0.0/28")


def kv(key: str, value: bytes, revision: int) -> KeyValue:
    return KeyValue(key, value, revision, revision, 1, 0)


def ip_kv(offset: int, revision: int, *, expires_at: float | None = None) -> KeyValue:
    ip = NET.network_address + offset
    a = Allocation(ip, NODE, Owner("c", "eth0"), NET, 1.0, expires_at)
    return kv(ip_key(NODE, ip), encode_allocation(a), revision)


def records(*kvs: KeyValue) -> list[tuple[object, object, int]]:
    codec = PoolCodec()
    out = []
    for item in kvs:
        key = codec.key(item.key)
        assert key is not None
        out.append((key, codec.decode(key, item), item.mod_revision))
    return out


def cache_at(revision: int, *kvs: KeyValue) -> PoolCache:
    cache = PoolCache(store=None)  # type: ignore[arg-type]
    cache.replace(records(kv(cidrs_key(NODE), encode_cidrs([NET]), 1), *kvs), revision)  # type: ignore[arg-type]
    return cache


def test_a_snapshot_rebuilds_the_pools_and_reservations() -> None:
    cache = cache_at(5, ip_kv(2, 3), ip_kv(3, 4, expires_at=99.0))
    assert cache.synced.is_set()
    assert cache.nodes[NODE].pools[Family.IPV4].used == {2, 3}
    assert list(cache.expired(100.0)) == [(NODE, Owner("c", "eth0"))]
    # A fresh snapshot (after a compaction) replaces everything.
    cache.replace(records(kv(cidrs_key(NODE), encode_cidrs([NET]), 1), ip_kv(4, 6)), 7)  # type: ignore[arg-type]
    assert cache.nodes[NODE].pools[Family.IPV4].used == {4}
    assert cache.expired(100.0) == {}


def test_events_of_one_response_are_applied_in_order() -> None:
    cache = cache_at(5)
    pool = cache.nodes[NODE].pools[Family.IPV4]
    taken = ip_kv(6, 8)
    cache.learn_used(pool, NET.network_address + 6, 8)  # our own write, before its event
    assert 6 in pool.used
    codec = PoolCodec()
    key = codec.key(taken.key)
    assert key is not None
    cache.commit([(key, codec.decode(key, taken), 8), (key, None, 9)], 9)
    assert 6 not in pool.used
    assert cache.revision == 9
    assert cache.get(key) is None


def test_an_event_older_than_a_full_read_of_the_pool_is_ignored() -> None:
    cache = cache_at(5)
    pool = cache.nodes[NODE].pools[Family.IPV4]
    # A re-read of the pool at revision 10 found offset 7 used (taken again
    # after a release at 9 whose event arrives only now).
    pool.replace_used([7], 10)
    cache.apply(False, kv(ip_kv(7, 9).key, b"", 9))
    assert 7 in pool.used
