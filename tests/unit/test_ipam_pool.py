"""Pure logic of ipam allocation: a node's Pool, block carving, and the
replica-side PoolCache fed by (lagging) watch events, checked with
hypothesis state machines."""

from __future__ import annotations

import ipaddress
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from flagella.common.etcd import KeyValue
from flagella.ipam.model import Family
from flagella.ipam.pool import Pool, capacity_of, free_block, reserved_reason
from flagella.ipam.store import PoolCache, cidrs_key, encode_cidrs, ip_key

# --- Pool ---


def test_pool_never_hands_out_network_gateway_or_broadcast() -> None:
    net = ipaddress.ip_network("10.0.0.0/29")
    pool = Pool(net, rng=random.Random(1))
    assert pool.capacity == capacity_of(net) == 5
    got = []
    while (off := pool.take()) is not None:
        got.append(str(pool.ip_at(off)))
    assert sorted(got, key=ipaddress.ip_address) == [f"10.0.0.{i}" for i in range(2, 7)]
    assert reserved_reason(net, ipaddress.ip_address("10.0.0.0")) == "is the network address"
    assert "gateway" in (reserved_reason(net, ipaddress.ip_address("10.0.0.1")) or "")
    assert "broadcast" in (reserved_reason(net, ipaddress.ip_address("10.0.0.7")) or "")
    assert reserved_reason(net, ipaddress.ip_address("10.0.0.3")) is None


def test_pool_rejects_a_cidr_without_room() -> None:
    with pytest.raises(ValueError, match="no address"):
        Pool(ipaddress.ip_network("10.0.0.0/31"))
    assert Pool(ipaddress.ip_network("fd00::/126")).capacity == 1


def test_pool_offsets_outside_or_other_family() -> None:
    pool = Pool(ipaddress.ip_network("10.0.0.0/24"))
    assert pool.offset_of(ipaddress.ip_address("10.0.1.1")) is None
    assert pool.offset_of(ipaddress.ip_address("::1")) is None
    assert pool.offset_of(ipaddress.ip_address("10.0.0.9")) == 9
    pool.mark_used(0)  # reserved offsets never count as used
    pool.mark_used(255)
    assert pool.used == set()


# --- blocks ---


def test_free_block_lowest_free_and_skips_overlaps() -> None:
    cluster = ipaddress.ip_network("10.0.0.0/16")
    n = ipaddress.ip_network
    assert free_block(cluster, 24, []) == n("10.0.0.0/24")
    assert free_block(cluster, 24, [n("10.0.0.0/24"), n("10.0.2.0/24")]) == n("10.0.1.0/24")
    # A block of another size (the mask changed) is skipped over.
    assert free_block(cluster, 24, [n("10.0.0.0/22")]) == n("10.0.4.0/24")
    assert free_block(n("10.0.0.0/23"), 24, [n("10.0.0.0/24"), n("10.0.1.0/24")]) is None
    with pytest.raises(ValueError, match="does not fit"):
        free_block(cluster, 8, [])


@given(
    prefix=st.integers(16, 22),
    mask_extra=st.integers(0, 4),
    taken=st.sets(st.integers(0, 15), max_size=16),
)
def test_free_block_is_disjoint_from_every_assigned_block(
    prefix: int, mask_extra: int, taken: set[int]
) -> None:
    cluster = ipaddress.ip_network(f"10.0.0.0/{prefix}")
    mask = prefix + mask_extra
    size = 1 << (32 - mask)
    count = 1 << mask_extra
    assigned = [
        ipaddress.ip_network((int(cluster.network_address) + i * size, mask))
        for i in taken
        if i < count
    ]
    block = free_block(cluster, mask, assigned)
    if len(assigned) == count:
        assert block is None
    else:
        assert block is not None
        assert block.prefixlen == mask
        assert block.subnet_of(cluster)  # type: ignore[arg-type]
        assert not any(block.overlaps(a) for a in assigned)


# --- allocate/release sequences on one pool ---

NETWORKS = st.sampled_from(
    ["10.1.0.0/28", "10.1.0.0/29", "10.1.0.0/30", "10.1.0.64/27", "fd00::/124", "fd00::40/125"]
)


class PoolMachine(RuleBasedStateMachine):
    """Allocate, allocate-given and release in any order: never a duplicate,
    never outside the range or a reserved address, exhaustion exactly when
    every usable address is held, a released address is usable again."""

    held = Bundle("held")

    @initialize(cidr=NETWORKS, seed=st.integers(0, 2**32))
    def setup(self, cidr: str, seed: int) -> None:
        self.net = ipaddress.ip_network(cidr)
        self.pool = Pool(self.net, rng=random.Random(seed))
        self.owned: set[int] = set()

    def _check_new(self, off: int) -> None:
        ip = self.pool.ip_at(off)
        assert ip in self.net
        assert reserved_reason(self.net, ip) is None
        assert off not in self.owned

    @rule(target=held)
    def allocate(self) -> int:
        off = self.pool.take()
        if len(self.owned) == self.pool.capacity:
            assert off is None, "handed out an address from a full pool"
            return -1
        assert off is not None, "reported exhausted with free addresses"
        self._check_new(off)
        self.pool.settle(off)
        self.pool.mark_used(off)
        self.owned.add(off)
        return off

    @rule(target=held, data=st.data())
    def allocate_given(self, data: st.DataObject) -> int:
        off = data.draw(st.integers(0, self.net.num_addresses - 1))
        ok = self.pool.take_given(off)
        free = self.pool.assignable(off) and off not in self.owned
        assert ok == free
        if not ok:
            return -1
        self._check_new(off)
        self.pool.settle(off)
        self.pool.mark_used(off)
        self.owned.add(off)
        return off

    @rule(off=consumes(held))
    def release(self, off: int) -> None:
        if off in self.owned:
            self.owned.remove(off)
            self.pool.mark_free(off)

    @precondition(lambda self: len(self.owned) == self.pool.capacity)
    @rule(data=st.data())
    def full_release_then_allocate_reuses(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.owned)))
        self.owned.remove(off)
        self.pool.mark_free(off)
        again = self.pool.take()
        assert again == off
        self.pool.settle(again)
        self.pool.mark_used(again)
        self.owned.add(again)

    @invariant()
    def view_matches(self) -> None:
        if hasattr(self, "pool"):
            assert self.pool.used == self.owned
            assert not self.pool.pending


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


# --- several replicas, each with a lagging view, one etcd ---


class ReplicaMachine(RuleBasedStateMachine):
    """Replicas allocate from their PoolCache (fed by watch events that
    arrive late and in order) and write create-if-absent to one truth, the
    way the service does, with the transaction's reply arriving after any
    number of watch events. Whatever the interleaving: no IP is granted
    twice, exhaustion is reported only when the range is full (after the
    re-read the service does), and once a replica has every event and every
    reply, its view equals the truth."""

    NODE = "n1"
    CIDR = "10.2.0.0/28"

    @initialize(replicas=st.integers(2, 3), seed=st.integers(0, 2**32))
    def setup(self, replicas: int, seed: int) -> None:
        self.revision = 1
        self.truth: dict[int, int] = {}  # offset -> mod revision
        self.caches = [PoolCache(store=None) for _ in range(replicas)]  # type: ignore[arg-type]
        self.queues: list[list[tuple[bool, KeyValue]]] = [[] for _ in range(replicas)]
        self.granted: set[int] = set()
        # (replica, offset, mod revision of the key) awaiting the txn reply
        self.in_flight: list[tuple[int, int, int]] = []
        cidrs = KeyValue(
            cidrs_key(self.NODE), encode_cidrs([ipaddress.ip_network(self.CIDR)]), 1, 1, 1, 0
        )
        rng = random.Random(seed)
        for cache in self.caches:
            cache.apply(True, cidrs)
            # Replicas start their cursors at different places.
            pool = self.pool(cache)
            pool.cursor = rng.randint(pool.first, pool.last)

    def pool(self, cache: PoolCache) -> Pool:
        return cache.nodes[self.NODE].pools[Family.IPV4]

    def _event(self, put: bool, off: int) -> None:
        ip = ipaddress.ip_network(self.CIDR).network_address + off
        value = (
            b'{"container_id":"c","ifname":"eth0","pod":"","cidr":"10.2.0.0/28",'
            b'"allocated_at":1.0,"expires_at":null}'
        )
        kv = KeyValue(
            ip_key(self.NODE, ip), value if put else b"", self.revision, self.revision, 1, 0
        )
        for q in self.queues:
            q.append((put, kv))

    @rule(r=st.integers(0, 2))
    def begin_allocate(self, r: int) -> None:
        """A replica picks a candidate and its transaction runs in etcd; the
        reply reaches the replica later (finish_allocate), and watch events
        may be delivered in between."""
        r %= len(self.caches)
        cache = self.caches[r]
        pool = self.pool(cache)
        off = pool.take()
        if off is None:
            # The service asks etcd and re-reads the pool.
            pool.replace_used(self.truth, self.revision)
            off = pool.take()
            if off is None:
                in_flight = {o for rr, o, _ in self.in_flight if rr == r}
                assert len(set(self.truth) | in_flight) == pool.capacity
                return
        assert reserved_reason(pool.network, pool.ip_at(off)) is None
        if off in self.truth:  # the compare fails: someone holds it
            self.in_flight.append((r, off, self.truth[off]))
            return
        self.revision += 1
        self.truth[off] = self.revision
        self._event(True, off)
        assert off not in self.granted
        self.granted.add(off)
        self.in_flight.append((r, off, self.revision))

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data())
    def finish_allocate(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.in_flight) - 1))
        r, off, mod_revision = self.in_flight.pop(i)
        cache = self.caches[r]
        pool = self.pool(cache)
        pool.settle(off)
        cache.learn_used(pool, pool.ip_at(off), mod_revision)

    @precondition(lambda self: bool(self.truth))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.truth)))
        del self.truth[off]
        self.granted.discard(off)
        self.revision += 1
        self._event(False, off)

    @rule(r=st.integers(0, 2), n=st.integers(1, 5))
    def deliver(self, r: int, n: int) -> None:
        r %= len(self.caches)
        for put, kv in self.queues[r][:n]:
            self.caches[r].apply(put, kv)
        del self.queues[r][:n]

    @rule(r=st.integers(0, 2))
    def resync(self, r: int) -> None:
        pool = self.pool(self.caches[r % len(self.caches)])
        pool.replace_used(self.truth, self.revision)

    @invariant()
    def caught_up_views_equal_the_truth(self) -> None:
        if not hasattr(self, "caches"):
            return
        for r, (cache, queue) in enumerate(zip(self.caches, self.queues, strict=True)):
            if not queue and not any(rr == r for rr, _, _ in self.in_flight):
                assert self.pool(cache).used == set(self.truth)


TestReplicaMachine = ReplicaMachine.TestCase
TestReplicaMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
