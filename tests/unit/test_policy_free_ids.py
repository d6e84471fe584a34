"""Picking a free identity once the top of the range was reached: the
search resumes after the last pick (next fit), wraps around, and says so
when every id is taken."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from flagella.common.errors import ResourceExhausted
from flagella.policy.allocator import IdentityAllocator
from flagella.policy.identities import MAX_GLOBAL, MIN_GLOBAL


def allocator(known: set[int]) -> IdentityAllocator:
    state = SimpleNamespace(identities=dict.fromkeys(known), max_global_id=MAX_GLOBAL)
    fake: Any = SimpleNamespace(state=state)
    return IdentityAllocator(fake, fake, fake)


def test_after_the_top_the_search_resumes_after_the_last_pick_and_wraps() -> None:
    free = {300, 40_000, 40_001, 65_000}
    alloc = allocator(set(range(MIN_GLOBAL, MAX_GLOBAL + 1)) - free)
    ids = alloc.state.identities

    def take() -> int:
        ident = alloc._candidate()
        ids[ident] = None  # taken, as the mirror would see it
        return ident

    assert [take(), take()] == [300, 40_000]
    del ids[300]  # freed again: not the next pick, but found after wrapping
    assert [take(), take(), take()] == [40_001, 65_000, 300]
    with pytest.raises(ResourceExhausted):
        alloc._candidate()


def test_below_the_top_ids_come_from_above_the_highest() -> None:
    alloc = allocator({256, 257})
    alloc.state.max_global_id = 257
    assert 258 <= alloc._candidate() <= 262
