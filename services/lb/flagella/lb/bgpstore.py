"""etcd state of BGP peering policies, under flagella/lb/v1/bgp/:

    bgp/policies/<name>    the policy (JSON, neighbours' passwords included:
                           only the lb's etcd user reads this prefix)

and the logic around it (no gRPC): create-or-replace with a compare on
what was read, delete, the listing, and the table every
WatchBgpPeeringPolicies stream of this replica follows (one etcd watch)."""

from __future__ import annotations

import logging

from flagella.common.errors import Aborted, FailedPrecondition, Unavailable
from flagella.common.etcd import (
    Compacted,
    Etcd,
    KeyValue,
    absent,
    delete_op,
    mod_revision_is,
    put_op,
)
from flagella.common.sync import EtcdSource, Subscription, Table
from flagella.lb.bgp import PeeringPolicy
from flagella.lb.store import PREFIX

POLICIES = PREFIX + "bgp/policies/"
MAX_ATTEMPTS = 16
# How long a write waits to show in this replica's own table.
VISIBLE_TIMEOUT = 2.0

log = logging.getLogger(__name__)


def policy_key(name: str) -> str:
    return f"{POLICIES}{name}"


class PolicyCodec:
    """bgp/policies/<name> -> the policy (a table's Codec)."""

    def key(self, key: str) -> str | None:
        return key[len(POLICIES) :] if key.startswith(POLICIES) else None

    def decode(self, key: str, kv: KeyValue) -> PeeringPolicy | None:
        try:
            return PeeringPolicy.from_json(kv.value, kv.mod_revision)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "BGP peering policy not readable, skipped",
                extra={"policy": key, "reason": repr(exc)},
            )
            return None


class BgpPolicyStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self.table: Table[str, PeeringPolicy] = Table("lb-bgp-policies")
        self.source = EtcdSource(etcd, self.table, PolicyCodec(), prefix=POLICIES)

    async def run(self) -> None:
        await self.source.run()

    async def put(self, policy: PeeringPolicy) -> tuple[PeeringPolicy, bool]:
        """Store policy, replacing the one of its name (of the same source).
        Returns it with its revision and whether it was created; the same
        policy again writes nothing."""
        key = policy_key(policy.name)
        value = policy.to_json()
        for _ in range(MAX_ATTEMPTS):
            kv = await self.etcd.get(key)
            if kv is not None:
                stored = PeeringPolicy.from_json(kv.value, kv.mod_revision)
                _owned(stored, policy.source, "policy.name")
                if kv.value == value:
                    return stored, False
            compare = absent(key) if kv is None else mod_revision_is(key, kv.mod_revision)
            result = await self.etcd.txn([compare], [put_op(key, value)])
            if result.succeeded:
                await self._visible(result.revision)
                return PeeringPolicy.from_json(value, result.revision), kv is None
        raise Aborted(
            f"policy {policy.name!r} kept changing concurrently; retry", field="policy.name"
        )

    async def delete(self, name: str, source: str = "api") -> bool:
        """Delete the policy (of that source: another's is refused)."""
        key = policy_key(name)
        for _ in range(MAX_ATTEMPTS):
            kv = await self.etcd.get(key)
            if kv is None:
                return False
            _owned(PeeringPolicy.from_json(kv.value, kv.mod_revision), source, "name")
            result = await self.etcd.txn([mod_revision_is(key, kv.mod_revision)], [delete_op(key)])
            if result.succeeded:
                await self._visible(result.revision)
                return True
        raise Aborted(f"policy {name} kept changing concurrently; retry", field="name")

    async def list(self) -> tuple[list[PeeringPolicy], int]:
        """Every policy, read from etcd at one revision."""
        try:
            records, revision = await self.source.read()
        except Compacted as exc:
            raise Unavailable("the listing's revision was compacted meanwhile; retry") from exc
        return sorted((r for _, r, _ in records), key=lambda r: r.name), revision

    def subscribe(self, since_revision: int = 0) -> Subscription[str, PeeringPolicy]:
        return self.table.subscribe(since_revision)

    async def _visible(self, revision: int) -> None:
        """Read your writes: a watch after the answer sees the change."""
        try:
            await self.table.wait_for(revision, VISIBLE_TIMEOUT)
        except TimeoutError:
            log.warning("BGP policy table lags behind a write", extra={"revision": revision})


def _owned(stored: PeeringPolicy, source: str, field: str) -> None:
    """A policy is changed only by the source that made it."""
    if stored.source != source:
        raise FailedPrecondition(
            f"BGP peering policy {stored.name!r} is managed by {stored.source}", field=field
        )
