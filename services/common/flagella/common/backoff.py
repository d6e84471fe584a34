"""The one retry policy of flagella: exponential, capped, with jitter.

Every loop that retries (a watch that broke, etcd not reachable yet, a peer
away) waits through a Backoff, so that replicas and nodes that lost the same
dependency at the same moment do not all come back at the same instant.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Backoff:
    """Delays of initial * multiplier**n, capped at maximum, each drawn
    uniformly from [(1 - jitter) * d, d] ("equal jitter" for jitter=0.5):
    never shorter than half the nominal delay, never longer than the cap."""

    def __init__(
        self,
        initial: float = 0.1,
        maximum: float = 5.0,
        *,
        multiplier: float = 2.0,
        jitter: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < initial <= maximum:
            raise ValueError("need 0 < initial <= maximum")
        if multiplier < 1:
            raise ValueError("multiplier must be at least 1")
        if not 0 <= jitter <= 1:
            raise ValueError("jitter must be within [0, 1]")
        self.initial = initial
        self.maximum = maximum
        self.multiplier = multiplier
        self.jitter = jitter
        self.rng = rng or random.Random()
        self.attempts = 0

    def nominal(self, attempt: int) -> float:
        """The delay before jitter for the attempt-th retry (0-based)."""
        try:
            return min(self.initial * self.multiplier**attempt, self.maximum)
        except OverflowError:  # a long outage: far past the cap
            return self.maximum

    def delay(self, attempt: int) -> float:
        """A jittered delay for the attempt-th retry (0-based), for callers
        that count attempts themselves (one count per key, say)."""
        return self.nominal(attempt) * (1 - self.jitter * self.rng.random())

    def next(self) -> float:
        """The next delay (and count one more attempt)."""
        delay = self.delay(self.attempts)
        self.attempts += 1
        return delay

    def reset(self) -> None:
        """After a success: the next failure starts from the initial delay."""
        self.attempts = 0

    async def wait(self) -> float:
        """Sleep the next delay; returns it."""
        delay = self.next()
        await asyncio.sleep(delay)
        return delay


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    backoff: Backoff | None = None,
) -> T:
    """call() until it returns, waiting through backoff after each failure
    of a retry_on kind (logged as `what`); anything else propagates."""
    backoff = backoff or Backoff()
    while True:
        try:
            return await call()
        except retry_on as exc:
            delay = backoff.next()
            log.warning(
                f"{what}: retrying",
                extra={"reason": getattr(exc, "message", None) or repr(exc), "retry_in_s": delay},
            )
            await asyncio.sleep(delay)
