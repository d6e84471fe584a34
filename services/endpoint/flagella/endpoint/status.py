"""CNI STATUS: whether an ADD can succeed now. It can when this service is
serving (started, etcd reachable) and every peer an ADD calls before the
node's datapath (ipam, policy) says it is serving; otherwise the answer
names each dependency that is not, with why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Readiness(Protocol):
    """This service's own readiness (flagella.common.server.Readiness)."""

    @property
    def serving(self) -> bool: ...

    @property
    def reasons(self) -> dict[str, str]: ...


class Dependency(Protocol):
    async def problem(self) -> str | None:
        """None while the dependency serves; else why not."""


class CniStatus:
    def __init__(self, readiness: Readiness, dependencies: Mapping[str, Dependency]) -> None:
        self.readiness = readiness
        self.dependencies = dict(dependencies)

    async def __call__(self) -> tuple[bool, dict[str, str]]:
        """(ready, the reason of each dependency that is not)."""
        problems = dict(self.readiness.reasons)
        for name, dependency in self.dependencies.items():
            problem = await dependency.problem()
            if problem is not None:
                problems[name] = problem
        return self.readiness.serving and not problems, problems
