"""Waiting in asyncio tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(done: Callable[[], bool], timeout: float = 5.0, step: float = 0.005) -> None:
    """Poll done() until it is true; AssertionError after timeout seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(step)
