"""KeyedLocks: one holder per key at a time, and nothing kept once unused."""

from __future__ import annotations

import asyncio

from flagella.common.locks import KeyedLocks


async def test_serializes_per_key_and_forgets_unused_keys() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def work(key: str, tag: str, delay: float) -> None:
        async with locks(key):
            order.append(f"{tag}+")
            await asyncio.sleep(delay)
            order.append(f"{tag}-")

    await asyncio.gather(work("a", "a1", 0.05), work("a", "a2", 0.0), work("b", "b1", 0.01))
    # a1 and a2 never overlap; b runs alongside a.
    a = [x for x in order if x.startswith("a")]
    assert a in (["a1+", "a1-", "a2+", "a2-"], ["a2+", "a2-", "a1+", "a1-"])
    assert order.index("b1+") < order.index("a1-")
    assert len(locks) == 0
