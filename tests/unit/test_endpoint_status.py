"""CNI STATUS of the endpoint service (status.py): ready only when the
service itself serves and every peer an ADD needs says it serves; the
answer names each dependency that does not, with why."""

from __future__ import annotations

from flagella.endpoint.status import CniStatus


class FakeReadiness:
    def __init__(self, serving: bool, reasons: dict[str, str]) -> None:
        self.serving = serving
        self.reasons = reasons


class FakePeer:
    def __init__(self, problem: str | None) -> None:
        self._problem = problem

    async def problem(self) -> str | None:
        return self._problem


async def test_ready_when_the_service_and_its_peers_serve() -> None:
    status = CniStatus(FakeReadiness(True, {}), {"ipam": FakePeer(None), "policy": FakePeer(None)})
    assert await status() == (True, {})


async def test_names_each_dependency_that_does_not_serve() -> None:
    readiness = FakeReadiness(False, {"etcd": "etcd unavailable"})
    status = CniStatus(
        readiness, {"ipam": FakePeer("unreachable: UNAVAILABLE"), "policy": FakePeer(None)}
    )
    ready, deps = await status()
    assert not ready
    assert deps == {"etcd": "etcd unavailable", "ipam": "unreachable: UNAVAILABLE"}
    assert readiness.reasons == {"etcd": "etcd unavailable"}  # not modified


async def test_a_peer_that_does_not_serve_makes_it_not_ready() -> None:
    status = CniStatus(FakeReadiness(True, {}), {"policy": FakePeer("not serving")})
    assert await status() == (False, {"policy": "not serving"})
