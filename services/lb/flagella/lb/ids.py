"""Id allocation logic (no I/O): id spaces with a moving hint, and the
assignment of backend ids from per-service blocks.

Ids are allocated in etcd by create-if-absent transactions (store.py); this
module only proposes candidates. A space hands out ids upward from a hint
that starts after the highest id in use, so a freed id is reused only after
the space wrapped around: an id is never reused while in use (etcd refuses
the transaction) and rarely soon after it was freed.

Backend ids come in blocks of BLOCK_SIZE owned by one service (the block's
key holds the service's name), so a service with hundreds of backends needs
a few keys in its transaction rather than one per backend (etcd allows 128
operations per transaction by default), and no id is ever shared by two
services.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flagella.lb.model import Backend, BackendSpec

BLOCK_SIZE = 64
# Backend ids are u32; block 0 is never handed out so that id 0 means "none".
# Ids from 0xFF000000 up are each datapath's own (local redirect policies'
# local backends: flagella.datapath.lrp).
BACKEND_BLOCK_MIN = 1
BACKEND_BLOCK_MAX = 0xFF000000 // BLOCK_SIZE - 1
# Service and rev-NAT ids are u16 in the datapath, as Cilium's.
SERVICE_ID_MIN = 1
SERVICE_ID_MAX = 65535


class IdSpace:
    """The integers lo..hi, handed out upward from a hint, wrapping."""

    def __init__(self, name: str, lo: int, hi: int) -> None:
        if not 0 <= lo <= hi:
            raise ValueError("bad id range")
        self.name = name
        self.lo = lo
        self.hi = hi
        self.hint = lo
        self.initialized = False
        # Ids known to be free (found by a scan), handed out first.
        self.preferred: list[int] = []

    @property
    def size(self) -> int:
        return self.hi - self.lo + 1

    def start_after(self, highest_in_use: int | None) -> None:
        """Restore the hint after a restart: just past the highest id in use."""
        self.hint = self.lo if highest_in_use is None else self._wrap(highest_in_use + 1)
        self.initialized = True

    def _wrap(self, value: int) -> int:
        return self.lo + (value - self.lo) % self.size

    def take(self, count: int) -> list[int]:
        """The next count candidates (distinct while count <= size): known
        free ones first, then upward from the hint, which moves past them so
        that concurrent callers get others."""
        count = min(count, self.size)
        out = self.preferred[:count]
        del self.preferred[:count]
        rest = count - len(out)
        out += [self._wrap(self.hint + k) for k in range(rest)]
        self.hint = self._wrap(self.hint + rest)
        return out

    def offer(self, free: list[int]) -> None:
        """Ids a scan found free: the next take() hands them out, and the hint
        moves past the last."""
        self.preferred = list(free)
        if free:
            self.hint = self._wrap(free[-1] + 1)


def free_in_window(taken: Iterable[int], start: int, end: int, count: int) -> list[int]:
    """Up to count integers of start..end (inclusive) not in taken (sorted
    ascending, may hold values outside the window)."""
    out: list[int] = []
    cursor = start
    for t in taken:
        if t < cursor:
            continue
        if t > end:
            break
        while cursor < t and len(out) < count:
            out.append(cursor)
            cursor += 1
        if len(out) >= count:
            return out
        cursor = t + 1
    while cursor <= end and len(out) < count:
        out.append(cursor)
        cursor += 1
    return out


@dataclass(frozen=True)
class BackendIdPlan:
    """Backend ids for a new list of backends of one service.

    ids[i] is the id of specs[i], or None when it needs one from a new block
    (blocks_needed of them; see complete())."""

    ids: tuple[int | None, ...]
    keep_blocks: tuple[int, ...]
    release_blocks: tuple[int, ...]
    blocks_needed: int
    # Ids of backends that are gone from the service.
    removed_ids: frozenset[int]

    def complete(self, new_blocks: Sequence[int]) -> tuple[list[int], tuple[int, ...]]:
        """Fill the missing ids from new_blocks (blocks_needed of them): the
        ids, and every block the service owns afterwards."""
        if len(new_blocks) != self.blocks_needed:
            raise ValueError("wrong number of new blocks")
        fresh = (b * BLOCK_SIZE + slot for b in new_blocks for slot in range(BLOCK_SIZE))
        ids = [i if i is not None else next(fresh) for i in self.ids]
        return ids, tuple(sorted((*self.keep_blocks, *new_blocks)))


def plan_backend_ids(
    old: Sequence[Backend], blocks: Sequence[int], specs: Sequence[BackendSpec]
) -> BackendIdPlan:
    """Keep the id of every backend that stays; give new backends free ids of
    the service's blocks (never an id freed by this same change, so the
    datapath sees a removal before any reuse), then ids of new blocks; release
    blocks left without a backend."""
    old_ids = {b.key: b.id for b in old}
    retained = {old_ids[s.key] for s in specs if s.key in old_ids}
    freed = set(old_ids.values()) - retained
    free_slots = (
        bid
        for block in sorted(blocks)
        for bid in range(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
        if bid not in retained and bid not in freed and bid != 0
    )
    ids: list[int | None] = []
    missing = 0
    for s in specs:
        if s.key in old_ids:
            ids.append(old_ids[s.key])
            continue
        slot = next(free_slots, None)
        ids.append(slot)
        if slot is None:
            missing += 1
    used_blocks = {i // BLOCK_SIZE for i in ids if i is not None}
    keep = tuple(b for b in sorted(blocks) if b in used_blocks)
    release = tuple(b for b in sorted(blocks) if b not in used_blocks)
    return BackendIdPlan(
        ids=tuple(ids),
        keep_blocks=keep,
        release_blocks=release,
        blocks_needed=math.ceil(missing / BLOCK_SIZE),
        removed_ids=frozenset(freed),
    )
