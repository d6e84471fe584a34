"""One leader among a service's replicas per job, elected with a
coordination.k8s.io/v1 Lease, as client-go's leaderelection package does:

- acquire: every retry period (jittered up to x2.2), read the Lease; take it
  (create it, or update it at the resourceVersion read, so that of two
  replicas trying at once the API server lets one win with 409 Conflict for
  the other) when nobody holds it, we do, or its record has not changed for
  leaseDurationSeconds as *we* observed it (a local clock only: no clock
  skew between replicas matters);
- lead: run the job while renewing every retry period; a renewal that has
  not succeeded for the renew deadline (the API server away), or a Lease
  someone else now holds, ends the leadership: the job is cancelled before
  the Lease can expire for the others (renew deadline < lease duration),
  so two leaders never write at once while clocks run at the same rate;
- release on stop: a leader that stops hands the Lease back (empty holder,
  1 s duration) so a follower takes over at its next try, not a lease
  duration later.

Usage: `election = Election.of(config)` once per process (the Leases'
namespace, this replica's identity, the timings), then per watcher
`await election.elector(api, "<lease name>").run(job)` until cancelled;
`job` is a coroutine function run while this replica leads (cancelled when
it stops leading; started afresh on the next term).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flagella.common.backoff import Backoff
from flagella.common.kubeapi import (
    KubeConfig,
    KubeRequestError,
    now_rfc3339,
    replica_identity,
    request,
)
from flagella.common.tasks import TaskGroup

log = logging.getLogger(__name__)

# client-go's JitterFactor for the acquire loop.
JITTER = 1.2


@dataclass(frozen=True, slots=True)
class LeaseTimings:
    """client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry."""

    lease_duration: int = 15
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    @classmethod
    def of(cls, cfg: KubeConfig) -> LeaseTimings:
        return cls(cfg.leader_lease_duration, cfg.leader_renew_deadline, cfg.leader_retry_period)


@dataclass(frozen=True, slots=True)
class Election:
    """How a service's replicas elect their watchers' leaders: the Leases'
    namespace, this replica's identity, the timings. One per process; each
    watcher gets its own elector (its own Lease) from it."""

    namespace: str
    identity: str
    timings: LeaseTimings = LeaseTimings()

    @classmethod
    def of(cls, cfg: KubeConfig) -> Election:
        """From the service's options, as a new replica."""
        return cls(cfg.leader_election_namespace, replica_identity(), LeaseTimings.of(cfg))

    def elector(self, api: Any, lease: str) -> LeaderElector:
        return LeaderElector(api, self.namespace, lease, self.identity, self.timings)


class LeaderElector:
    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        timings: LeaseTimings | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timings = timings or LeaseTimings()
        self.is_leader = False
        self.holder = ""  # the holder last seen in the Lease
        self.terms = 0  # leaderships begun, for tests and status
        self.leading = asyncio.Event()
        # Whether the Lease is ours to release (held and not lost).
        self._holding = False
        # The Lease's spec as last read, and when (monotonic) it last changed.
        self._observed: Mapping[str, Any] | None = None
        self._observed_at = 0.0
        self._resource_version = ""
        # Tries every retry period plus up to JITTER times more: a uniform
        # draw from [p, (1 + JITTER) p], as wait.JitterUntil does.
        longest = self.timings.retry_period * (1 + JITTER)
        self._acquire_backoff = Backoff(
            longest, longest, multiplier=1.0, jitter=JITTER / (1 + JITTER)
        )

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"

    async def run(self, job: Callable[[], Awaitable[None]]) -> None:
        """Campaign, lead, and campaign again, until cancelled (then the
        Lease is released if held)."""
        try:
            while True:
                await self._acquire()
                await self._lead(job)
        finally:
            if self._holding:
                self._step_down("stopping")
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._release())

    # --- the phases ---

    async def _acquire(self) -> None:
        while True:
            if await self._try_acquire_or_renew():
                break
            await asyncio.sleep(self._acquire_backoff.next())
        self._holding = True
        self.is_leader = True
        self.terms += 1
        self.leading.set()
        log.info(
            "leading",
            extra={"lease": f"{self.namespace}/{self.name}", "identity": self.identity},
        )

    async def _lead(self, job: Callable[[], Awaitable[None]]) -> None:
        # The job lives as long as this term: the group cancels it on the
        # way out, whatever ends the term.
        try:
            async with TaskGroup(f"leader {self.name}") as term:
                await self._renew_until_lost(term.spawn(f"leader-{self.name}", self._job(job)))
        finally:
            # Only now, the job stopped: is_leader False means no job runs.
            self.is_leader = False
            self.leading.clear()

    async def _job(self, job: Callable[[], Awaitable[None]]) -> None:
        try:
            await job()
            log.warning("leader's job returned", extra={"lease": self.name})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("leader's job failed", extra={"lease": self.name})

    async def _renew_until_lost(self, task: asyncio.Task[None]) -> None:
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        while True:
            await asyncio.sleep(self.timings.retry_period)
            if task.done():
                # The job ended (a bug, logged): let another replica try.
                self._step_down("its job ended")
                await self._release()
                self._holding = False
                await asyncio.sleep(self.timings.retry_period)
                return
            if await self._try_acquire_or_renew():
                renewed = loop.time()
            elif self.holder and self.holder != self.identity:
                self._step_down(f"the lease is held by {self.holder}", lost=True)
                return
            elif loop.time() - renewed >= self.timings.renew_deadline:
                self._step_down("not renewed within the renew deadline", lost=True)
                return

    def _step_down(self, reason: str, *, lost: bool = False) -> None:
        """Ends the term (the job is stopped on the way out of _lead).
        lost: the Lease is not ours any more (nothing to release)."""
        if lost:
            self._holding = False
        log.warning(
            "stopped leading",
            extra={"lease": f"{self.namespace}/{self.name}", "reason": reason},
        )

    # --- the Lease ---

    async def _try_acquire_or_renew(self) -> bool:
        try:
            return await self._attempt()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info(
                "lease not acquired or renewed",
                extra={"lease": f"{self.namespace}/{self.name}", "error": repr(exc)[:300]},
            )
            return False

    async def _attempt(self) -> bool:
        try:
            lease = await request(self.api, "GET", f"{self.path}/{self.name}")
        except KubeRequestError as exc:
            if exc.status != 404:
                raise
            return await self._write("POST", self.path, self._lease({}, ""))
        spec: Mapping[str, Any] = lease.get("spec") or {}
        now = time.monotonic()
        if spec != self._observed:
            self._observed, self._observed_at = spec, now
        self.holder = str(spec.get("holderIdentity") or "")
        duration = int(spec.get("leaseDurationSeconds") or self.timings.lease_duration)
        if self.holder and self.holder != self.identity and now < self._observed_at + duration:
            return False
        version = (lease.get("metadata") or {}).get("resourceVersion", "")
        return await self._write("PUT", f"{self.path}/{self.name}", self._lease(spec, version))

    def _lease(self, held: Mapping[str, Any], resource_version: str) -> dict[str, Any]:
        """The Lease taken or renewed by us, from the spec held now ({}: none)."""
        mine = held.get("holderIdentity") == self.identity
        stamp = now_rfc3339(micro=True)
        metadata = {"name": self.name, "namespace": self.namespace}
        if resource_version:
            metadata["resourceVersion"] = resource_version
        transitions = int(held.get("leaseTransitions") or 0)
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.timings.lease_duration,
                "acquireTime": held.get("acquireTime") if mine else stamp,
                "renewTime": stamp,
                "leaseTransitions": transitions if mine or not held else transitions + 1,
            },
        }

    async def _write(self, method: str, path: str, body: Mapping[str, Any]) -> bool:
        """Create or update the Lease; False when another replica wrote it
        first (409: it exists, or our resourceVersion is stale)."""
        try:
            stored = await request(self.api, method, path, body)
        except KubeRequestError as exc:
            if exc.status == 409:
                return False
            raise
        self._took(stored)
        return True

    def _took(self, stored: Mapping[str, Any]) -> None:
        self._observed = stored.get("spec") or {}
        self._observed_at = time.monotonic()
        self.holder = self.identity

    async def _release(self) -> None:
        """Hand the Lease back, if we still hold it (client-go's
        ReleaseOnCancel: empty holder, 1 s duration)."""
        try:
            lease = await request(self.api, "GET", f"{self.path}/{self.name}", timeout=2)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            stamp = now_rfc3339(micro=True)
            body = {
                **lease,
                "spec": {
                    "holderIdentity": "",
                    "leaseDurationSeconds": 1,
                    "acquireTime": stamp,
                    "renewTime": stamp,
                    "leaseTransitions": int(spec.get("leaseTransitions") or 0),
                },
            }
            await request(self.api, "PUT", f"{self.path}/{self.name}", body, timeout=2)
            log.info("lease released", extra={"lease": f"{self.namespace}/{self.name}"})
        except Exception as exc:
            log.info("lease not released", extra={"lease": self.name, "error": repr(exc)[:300]})
