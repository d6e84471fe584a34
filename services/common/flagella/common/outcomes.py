"""Operation outcomes counted in memory, for the service's metrics: service
logic counts what it does (no Prometheus, no gRPC here) and its collector
exports the counts at scrape time (flagella.common.metrics.outcome_family).

The outcome is "success", or the failure's status in snake case
("invalid_argument", "resource_exhausted", "unavailable", ...; "internal"
for an unexpected exception): a bounded set, whatever the requests. A call
that is cancelled is not counted (it has no outcome)."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from flagella.common.errors import FlagellaError

P = ParamSpec("P")
T = TypeVar("T")

SUCCESS = "success"


def outcome_of(exc: BaseException) -> str:
    return exc.code.lower() if isinstance(exc, FlagellaError) else "internal"


class Outcomes:
    """(label values..., outcome) -> count."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, ...]] = Counter()

    @contextlib.contextmanager
    def counting(self, *labels: str) -> Iterator[None]:
        """Counts the block under labels with the outcome it ends with."""
        try:
            yield
        except Exception as exc:
            self.counts[(*labels, outcome_of(exc))] += 1
            raise
        self.counts[(*labels, SUCCESS)] += 1

    def record(self, *labels: str, outcome: str = SUCCESS) -> None:
        """Counts one operation that ended outside a counting() block."""
        self.counts[(*labels, outcome)] += 1


class Counted(Protocol):
    @property
    def outcomes(self) -> Outcomes: ...


S = TypeVar("S", bound=Counted)


def counted(
    *labels: str,
) -> Callable[
    [Callable[Concatenate[S, P], Awaitable[T]]], Callable[Concatenate[S, P], Awaitable[T]]
]:
    """A method of an object with `outcomes`, each call counted under labels."""

    def wrap(
        method: Callable[Concatenate[S, P], Awaitable[T]],
    ) -> Callable[Concatenate[S, P], Awaitable[T]]:
        @functools.wraps(method)
        async def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
            with self.outcomes.counting(*labels):
                return await method(self, *args, **kwargs)

        return call

    return wrap
