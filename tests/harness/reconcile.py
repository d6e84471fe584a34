"""Reconciler operations that do nothing, for tests of desired state alone."""

from __future__ import annotations

from collections.abc import Iterable


class NoOps:
    async def update(self, key: object, value: object) -> None:
        pass

    async def delete(self, key: object) -> None:
        pass

    async def list_actual(self) -> Iterable[object]:
        return []
