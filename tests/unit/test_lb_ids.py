"""Id allocation logic: id spaces, gap finding, backend-id blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flagella.lb.ids import (
    BLOCK_SIZE,
    IdSpace,
    free_in_window,
    plan_backend_ids,
)
from flagella.lb.model import Backend, BackendSpec


def test_space_hands_out_upward_from_after_the_highest_in_use_and_wraps() -> None:
    space = IdSpace("svc", 1, 10)
    space.start_after(7)
    assert space.take(2) == [8, 9]
    assert space.take(3) == [10, 1, 2]
    space.start_after(None)
    assert space.take(1) == [1]
    space.start_after(10)
    assert space.take(1) == [1]


def test_space_hands_out_known_free_ids_first() -> None:
    space = IdSpace("svc", 1, 100)
    space.start_after(50)
    space.offer([3, 9])
    assert space.take(3) == [3, 9, 10]
    assert space.take(1) == [11]


def test_concurrent_takes_get_distinct_candidates() -> None:
    space = IdSpace("svc", 1, 65535)
    space.start_after(0)
    taken = [i for _ in range(100) for i in space.take(3)]
    assert len(set(taken)) == len(taken)


@given(
    taken=st.lists(st.integers(0, 60), unique=True).map(sorted),
    start=st.integers(0, 60),
    end=st.integers(0, 60),
    count=st.integers(0, 70),
)
def test_free_in_window(taken: list[int], start: int, end: int, count: int) -> None:
    got = free_in_window(taken, start, end, count)
    want = [i for i in range(start, end + 1) if i not in set(taken)][:count]
    assert got == want


def _backends(*ids_addrs: tuple[int, str]) -> tuple[Backend, ...]:
    return tuple(Backend(i, a, 80) for i, a in ids_addrs)


def test_backend_ids_kept_for_backends_that_stay() -> None:
    old = _backends((64, "10.0.0.1"), (65, "10.0.0.2"), (66, "10.0.0.3"))
    specs = [BackendSpec("10.0.0.3", 80), BackendSpec("10.0.0.1", 80, weight=7)]
    plan = plan_backend_ids(old, [1], specs)
    assert plan.ids == (66, 64)
    assert plan.removed_ids == {65}
    assert plan.keep_blocks == (1,)
    assert plan.release_blocks == ()
    assert plan.blocks_needed == 0


def test_new_backend_never_gets_an_id_freed_by_the_same_change() -> None:
    old = _backends((64, "10.0.0.1"), (65, "10.0.0.2"))
    specs = [BackendSpec("10.0.0.1", 80), BackendSpec("10.0.0.9", 80)]
    plan = plan_backend_ids(old, [1], specs)
    assert plan.ids == (64, 66)
    assert plan.removed_ids == {65}


def test_new_blocks_when_the_service_outgrows_its_own() -> None:
    old = _backends(*((64 + i, f"10.0.0.{i + 1}") for i in range(BLOCK_SIZE)))
    specs = [BackendSpec(f"10.0.0.{i + 1}", 80) for i in range(BLOCK_SIZE)] + [
        BackendSpec(f"10.0.1.{i + 1}", 80) for i in range(BLOCK_SIZE + 1)
    ]
    plan = plan_backend_ids(old, [1], specs)
    assert plan.blocks_needed == 2
    ids, blocks = plan.complete([7, 9])
    assert blocks == (1, 7, 9)
    assert ids[:BLOCK_SIZE] == list(range(64, 128))
    assert ids[BLOCK_SIZE:] == [*range(7 * 64, 8 * 64), 9 * 64]
    assert len(set(ids)) == len(ids)


def test_blocks_without_backends_are_released() -> None:
    old = _backends((64, "10.0.0.1"), (7 * 64, "10.0.0.2"))
    plan = plan_backend_ids(old, [1, 7], [BackendSpec("10.0.0.2", 80)])
    assert plan.keep_blocks == (7,)
    assert plan.release_blocks == (1,)
    plan = plan_backend_ids(old, [1, 7], [])
    assert plan.release_blocks == (1, 7)
    assert plan.removed_ids == {64, 7 * 64}


@settings(max_examples=60)
@given(
    old_n=st.integers(0, 150),
    keep=st.sets(st.integers(0, 149)),
    new_n=st.integers(0, 150),
)
def test_backend_ids_unique_within_owned_blocks_and_stable(
    old_n: int, keep: set[int], new_n: int
) -> None:
    old_specs = [BackendSpec(f"10.1.{i // 200}.{i % 200 + 1}", 80) for i in range(old_n)]
    first = plan_backend_ids((), (), old_specs)
    ids, blocks = first.complete(list(range(3, 3 + first.blocks_needed)))
    old = tuple(Backend(i, s.address, s.port) for i, s in zip(ids, old_specs, strict=True))
    specs = [s for i, s in enumerate(old_specs) if i in keep] + [
        BackendSpec(f"10.2.{i // 200}.{i % 200 + 1}", 80) for i in range(new_n)
    ]
    plan = plan_backend_ids(old, blocks, specs)
    new_blocks = list(range(100, 100 + plan.blocks_needed))
    new_ids, owned = plan.complete(new_blocks)
    assert len(set(new_ids)) == len(new_ids)
    assert 0 not in new_ids
    assert {i // BLOCK_SIZE for i in new_ids} <= set(owned)
    # Every owned block holds at least one backend (the rest were released).
    assert set(owned) == {i // BLOCK_SIZE for i in new_ids}
    assert set(plan.release_blocks).isdisjoint(owned)
    # Backends that stay keep their ids; none reuses an id freed now.
    by_addr = {b.address: b.id for b in old}
    for s, i in zip(specs, new_ids, strict=True):
        if s.address in by_addr:
            assert i == by_addr[s.address]
        else:
            assert i not in plan.removed_ids
