"""flagella.common.leader against KubeListWatchServer, the local HTTP server
that stands in for the API server (harness/kube_api.py; its Leases answer
409 Conflict to an update at a stale resourceVersion, as the real one does),
through the real kubernetes.aio client: one leader among several electors,
renewals, a takeover once the leader's Lease runs out, a release on stop,
and a leader that cannot renew stopping before its Lease expires."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.aio import until
from harness.kube_api import KubeListWatchServer

from flagella.common.leader import LeaderElector, LeaseTimings
from flagella.common.tasks import TaskGroup

pytestmark = pytest.mark.integration

FAST = LeaseTimings(lease_duration=1, renew_deadline=0.6, retry_period=0.1)


@pytest.fixture
def kube_api() -> Iterator[KubeListWatchServer]:
    with KubeListWatchServer() as server:
        yield server


@contextlib.asynccontextmanager
async def api_client(kube_api: KubeListWatchServer, tmp_path: Path) -> AsyncIterator[Any]:
    from kubernetes.aio import config

    api = await config.new_client_from_config(
        config_file=str(kube_api.write_kubeconfig(tmp_path / "kubeconfig"))
    )
    try:
        yield api
    finally:
        await api.close()


class Job:
    """What a leader runs: counts its terms and how many run at once."""

    running = 0
    most = 0

    def __init__(self) -> None:
        self.terms = 0

    async def __call__(self) -> None:
        self.terms += 1
        Job.running += 1
        Job.most = max(Job.most, Job.running)
        try:
            await asyncio.Event().wait()
        finally:
            Job.running -= 1


async def test_one_leader_among_three_on_the_stand_in_api_server_then_takeovers(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    Job.running = Job.most = 0
    async with api_client(kube_api, tmp_path) as api:
        electors = [LeaderElector(api, "flagella", "job", f"r{i}", FAST) for i in range(3)]
        jobs = [Job() for _ in electors]
        groups = [TaskGroup(f"r{i}") for i in range(3)]
        for group, elector, job in zip(groups, electors, jobs, strict=True):
            group.spawn("elect", elector.run(job))
        await until(lambda: any(e.is_leader for e in electors))
        await asyncio.sleep(1.5)  # several lease durations: renewed, never lost
        leaders = [e for e in electors if e.is_leader]
        assert len(leaders) == 1
        assert leaders[0].terms == 1
        lease = kube_api.lease("flagella", "job")
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == leaders[0].identity
        assert lease["spec"]["leaseDurationSeconds"] == 1
        # The renewTime is a MicroTime: six fractional digits.
        assert len(lease["spec"]["renewTime"].split(".")[1]) == len("000000Z")

        # Stopped: the Lease is released and another takes over at its next
        # try, well before the lease duration.
        first = electors.index(leaders[0])
        await groups[first].stop()
        released = kube_api.lease("flagella", "job")
        assert released is not None
        # Released ("" ), or already taken by the next one at its retry.
        assert released["spec"]["holderIdentity"] != leaders[0].identity
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await until(lambda: sum(e.is_leader for e in electors) == 1)
        assert loop.time() - t0 < 0.6
        second = next(e for e in electors if e.is_leader)
        assert kube_api.lease("flagella", "job")["spec"]["leaseTransitions"] == 1  # type: ignore[index]
        # The leader last: stopped first, it would hand the Lease to the
        # third, a term this test does not count.
        by_leadership = sorted(zip(groups, electors, strict=True), key=lambda ge: ge[1].is_leader)
        for group, _elector in by_leadership:
            await group.stop()
        assert Job.most == 1, "two jobs ran at once"
        assert sum(j.terms for j in jobs) == 2
        assert second.identity != leaders[0].identity


async def test_a_leader_that_cannot_renew_on_the_stand_in_api_server_stops_before_expiry(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    Job.running = Job.most = 0
    async with api_client(kube_api, tmp_path) as api:
        elector = LeaderElector(api, "flagella", "job", "only", FAST)
        job = Job()
        async with TaskGroup() as group:
            group.spawn("elect", elector.run(job))
            await until(lambda: elector.is_leader)
            kube_api.down()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await until(lambda: not elector.is_leader and Job.running == 0)
            # Lost, and the job stopped, within the renew deadline (plus a
            # try), before the lease duration: nobody else could have taken
            # over yet.
            assert loop.time() - t0 < FAST.lease_duration
            kube_api.up()
            # The new term's job starts just after the flag turns.
            await until(lambda: elector.is_leader and job.terms >= 2)
            assert job.terms == 2


async def test_a_lease_held_by_another_on_the_stand_in_api_server_is_taken_only_once_expired(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    # Another holder's Lease, renewed by nobody (that holder died).
    kube_api.apply(
        "leases",
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "job", "namespace": "flagella"},
            "spec": {"holderIdentity": "dead", "leaseDurationSeconds": 1, "leaseTransitions": 4},
        },
    )
    async with api_client(kube_api, tmp_path) as api:
        elector = LeaderElector(api, "flagella", "job", "me", FAST)
        async with TaskGroup() as group:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            group.spawn("elect", elector.run(Job()))
            await until(lambda: elector.is_leader)
            # Not before the duration as this elector observed it.
            assert loop.time() - t0 >= 1.0
            lease = kube_api.lease("flagella", "job")
            assert lease is not None
            assert lease["spec"]["holderIdentity"] == "me"
            assert lease["spec"]["leaseTransitions"] == 5
