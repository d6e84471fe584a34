"""etcd state of LB-IPAM, under flagella/lb/v1/lbipam/ (the lb service's
own prefix, so its etcd role already covers it):

    pools                the pools (one JSON list: a pool's overlap check and
                         its write are one compare)
    addrs/<address>      who holds the address (AddressUse)
    services/<name>      a LoadBalancer service's request, addresses and
                         condition (Claim)

Every change reads the whole prefix at one revision, plans (lbipam.plan),
and commits in one transaction comparing the mod revision of every key it
read a decision from (the pools, the service's claim, each address it
takes or frees): two lb replicas can never hand one address out twice; the
loser reads again and plans again.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flagella.common.backoff import Backoff
from flagella.common.errors import Aborted, FailedPrecondition, InvalidArgument
from flagella.common.etcd import Etcd, KeyValue, delete_op, mod_revision_is, put_op
from flagella.common.sync import EtcdSource, Table
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.lb.lbipam import (
    SATISFIED,
    SOURCE_API,
    AddressUse,
    Assigned,
    Claimant,
    Condition,
    LbRequest,
    Pool,
    conflicts,
    overlap,
    plan,
    usable,
)
from flagella.lb.model import Frontend
from flagella.lb.store import PREFIX

LBIPAM = PREFIX + "lbipam/"
POOLS_KEY = LBIPAM + "pools"
ADDRS = LBIPAM + "addrs/"
CLAIMS = LBIPAM + "services/"
MAX_ATTEMPTS = 16

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """A LoadBalancer service's request and what it got."""

    claimant: Claimant
    addresses: tuple[str, ...] = ()
    condition: Condition = SATISFIED

    def to_json(self) -> bytes:
        c = self.claimant
        doc = {
            "name": c.name,
            "namespace": c.namespace,
            "labels": dict(c.labels),
            "ports": sorted([list(p) for p in c.ports]),
            "request": {
                "requested": list(c.request.requested),
                "sharing_key": c.request.sharing_key,
                "families": list(c.request.families),
            },
            "addresses": list(self.addresses),
            "condition": {
                "satisfied": self.condition.satisfied,
                "reason": self.condition.reason,
                "message": self.condition.message,
            },
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Claim:
        doc = json.loads(raw)
        req = doc["request"]
        cond = doc["condition"]
        return cls(
            Claimant(
                name=doc["name"],
                namespace=doc.get("namespace", ""),
                labels=dict(doc.get("labels", {})),
                ports=frozenset((str(p), int(q)) for p, q in doc.get("ports", [])),
                request=LbRequest(
                    tuple(req.get("requested", ())),
                    req.get("sharing_key", ""),
                    tuple(int(f) for f in req.get("families", (4,))),
                ),
            ),
            tuple(doc.get("addresses", ())),
            Condition(bool(cond["satisfied"]), cond["reason"], cond.get("message", "")),
        )


@dataclass
class State:
    """Everything under lbipam/ at one revision, with each key's mod revision."""

    pools: list[Pool]
    pools_rev: int
    uses: dict[str, AddressUse]
    use_revs: dict[str, int]
    claims: dict[str, Claim]
    claim_revs: dict[str, int]


@dataclass(frozen=True)
class PoolStatus:
    """A pool as listed: its addresses in use, and why it is not used
    (a Kubernetes pool overlapping another; empty when it is)."""

    pool: Pool
    used: int
    conflict: str = ""


class ClaimCodec:
    """services/<name> -> the Claim (the claims table's Codec)."""

    def key(self, key: str) -> str | None:
        return key[len(CLAIMS) :] if key.startswith(CLAIMS) else None

    def decode(self, key: str, kv: KeyValue) -> Claim | None:
        try:
            return Claim.from_json(kv.value)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "LB-IPAM claim not readable, skipped", extra={"name": key, "reason": repr(exc)}
            )
            return None


@dataclass(frozen=True)
class Contended:
    """Another writer changed a key the plan was made from."""


def _pools_json(pools: Sequence[Pool]) -> bytes:
    docs = [p.to_doc() for p in sorted(pools, key=lambda p: p.name)]
    return json.dumps(docs, separators=(",", ":")).encode()


class LbIpam:
    """LB-IPAM over etcd: pools, claims, and their retries on contention."""

    def __init__(
        self,
        etcd: Etcd,
        on_change: Callable[[str, tuple[str, ...]], Awaitable[None]] | None = None,
    ) -> None:
        self.etcd = etcd
        # Told a service's new addresses after each commit that changed
        # them (the lb service records them in the service, for the
        # datapaths).
        self.on_change = on_change
        # Every claim as etcd has it, for the Kubernetes watcher's status
        # write-back (whichever replica changed it); fed by run_claims().
        self.claims_table: Table[str, Claim] = Table("lbipam-claims", log_size=LOCAL_LOG_SIZE)

    async def run_claims(self) -> None:
        """Keep claims_table in step with etcd (until cancelled)."""
        await EtcdSource(self.etcd, self.claims_table, ClaimCodec(), prefix=CLAIMS).run()

    async def read(self) -> State:
        (kvs,), _ = await self.etcd.get_prefixes([LBIPAM])
        state = State([], 0, {}, {}, {}, {})
        for kv in kvs:
            key = kv.key
            if key == POOLS_KEY:
                state.pools = [Pool.from_doc(d) for d in json.loads(kv.value)]
                state.pools_rev = kv.mod_revision
            elif key.startswith(ADDRS):
                addr = key[len(ADDRS) :]
                state.uses[addr] = AddressUse.from_json(kv.value)
                state.use_revs[addr] = kv.mod_revision
            elif key.startswith(CLAIMS):
                name = key[len(CLAIMS) :]
                state.claims[name] = Claim.from_json(kv.value)
                state.claim_revs[name] = kv.mod_revision
        return state

    # --- pools ---

    async def upsert_pool(self, pool: Pool) -> tuple[bool, int]:
        """Store pool (refused, naming the block, when it overlaps another
        pool); then every claim is planned again. Returns (created,
        addresses used in it)."""
        for _ in range(MAX_ATTEMPTS):
            state = await self.read()
            _check_source(state.pools, pool.name, pool.source, "pool.name")
            refused = overlap(pool, state.pools)
            if refused is not None:
                raise refused
            created = all(p.name != pool.name for p in state.pools)
            if pool in state.pools:
                # Unchanged (the Kubernetes watcher syncs every object at
                # each term and status change): nothing to write or re-plan.
                return False, _used(pool, state.uses)
            pools = [p for p in state.pools if p.name != pool.name] + [pool]
            if await self._put_pools(pools, state.pools_rev):
                await self.reconcile_all()
                return created, _used(pool, (await self.read()).uses)
        raise Aborted("pools changed too often meanwhile; retry")

    async def delete_pool(self, name: str, source: str = SOURCE_API) -> bool:
        for _ in range(MAX_ATTEMPTS):
            state = await self.read()
            _check_source(state.pools, name, source, "name")
            pools = [p for p in state.pools if p.name != name]
            if len(pools) == len(state.pools):
                return False
            if await self._put_pools(pools, state.pools_rev):
                await self.reconcile_all()
                return True
        raise Aborted("pools changed too often meanwhile; retry")

    async def list_pools(self) -> list[PoolStatus]:
        state = await self.read()
        bad = conflicts(state.pools)
        return [
            PoolStatus(p, _used(p, state.uses), bad.get(p.name, ""))
            for p in sorted(state.pools, key=lambda p: p.name)
        ]

    async def _put_pools(self, pools: Sequence[Pool], rev: int) -> bool:
        result = await self.etcd.txn(
            [mod_revision_is(POOLS_KEY, rev)], [put_op(POOLS_KEY, _pools_json(pools))]
        )
        return result.succeeded

    # --- claims ---

    async def claim(self, who: Claimant) -> Claim:
        """Plan who's addresses and commit them (and free what it no longer
        holds). An unsatisfiable request stores the claim with no address
        and its condition."""
        # Contenders planned from the same state pick the same address:
        # jittered waits spread them out.
        backoff = Backoff(0.005, 0.2, jitter=1.0)
        for _ in range(MAX_ATTEMPTS):
            state = await self.read()
            outcome = await self._commit(state, who)
            if isinstance(outcome, Claim):
                return outcome
            await backoff.wait()
        raise Aborted("addresses changed too often meanwhile; retry")

    async def release(self, name: str) -> bool:
        """Forget name's claim and free its addresses. Whether it had one."""
        for _ in range(MAX_ATTEMPTS):
            state = await self.read()
            if name not in state.claims:
                return False
            if not isinstance(await self._commit(state, None, name), Contended):
                # Its addresses are free: pending claims may be satisfied now.
                await self.reconcile_all(pending_only=True)
                return True
        raise Aborted("addresses changed too often meanwhile; retry")

    async def users_of(self, addresses: Sequence[str]) -> dict[str, AddressUse]:
        """Who holds each of these addresses (those LB-IPAM gave out)."""
        found: dict[str, AddressUse] = {}
        for addr in dict.fromkeys(addresses):
            kv = await self.etcd.get(ADDRS + addr)
            if kv is not None:
                found[addr] = AddressUse.from_json(kv.value)
        return found

    async def check_external_ips(self, name: str, frontends: Sequence[Frontend]) -> None:
        """An external IP (as a frontend: address, port, protocol) that
        LB-IPAM gave another service serving it on the same protocol and
        port is refused, naming that service (the frontend index covers
        frontends and external IPs)."""
        if not frontends:
            return
        users = await self.users_of([fe.address for fe in frontends])
        for i, fe in enumerate(frontends):
            use = users.get(fe.address)
            if use is None:
                continue
            for other, ports in sorted(use.users.items()):
                if other != name and (fe.protocol.value, fe.port) in ports:
                    raise InvalidArgument(
                        f"{fe.address} port {fe.port}/{fe.protocol.value} is the LoadBalancer "
                        f"address of service {other!r}",
                        field=f"service.external_ips[{i}]",
                    )

    async def claims(self) -> dict[str, Claim]:
        return (await self.read()).claims

    async def get(self, name: str) -> Claim | None:
        kv = await self.etcd.get(CLAIMS + name)
        return None if kv is None else Claim.from_json(kv.value)

    async def reconcile_all(self, *, pending_only: bool = False) -> None:
        """Plan every claim again (after a pool changed): pending ones may
        be satisfied now, and addresses no pool selects any more move."""
        for name, claim in sorted((await self.read()).claims.items()):
            if pending_only and claim.condition.satisfied:
                continue
            try:
                await self.claim(claim.claimant)
            except Aborted:
                log.warning("LB-IPAM: claim of %s not re-planned (contention)", name)

    async def _commit(
        self, state: State, who: Claimant | None, name: str = ""
    ) -> Claim | Contended | None:
        """Commit who's plan (None: release name). The claim stored (None
        when released), or Contended."""
        name = who.name if who is not None else name
        old = state.claims.get(name)
        held = old.addresses if old is not None else ()
        if who is None:
            claim: Claim | None = None
            new: tuple[str, ...] = ()
        else:
            # Plan as if it held nothing, so its own uses do not block it.
            uses = {a: u.without(name) for a, u in state.uses.items()}
            outcome = plan(who, usable(state.pools), {a: u for a, u in uses.items() if u}, held)
            if isinstance(outcome, Assigned):
                claim = Claim(who, outcome.addresses, SATISFIED)
            else:
                claim = Claim(who, (), outcome.condition)
            new = claim.addresses
        compare = [
            mod_revision_is(POOLS_KEY, state.pools_rev),
            mod_revision_is(CLAIMS + name, state.claim_revs.get(name, 0)),
        ]
        ops: list[Any] = []
        for addr in sorted(set(held) | set(new)):
            compare.append(mod_revision_is(ADDRS + addr, state.use_revs.get(addr, 0)))
            use = state.uses.get(addr, AddressUse())
            after = use.with_user(who) if (who is not None and addr in new) else use.without(name)
            if after is None:
                ops.append(delete_op(ADDRS + addr))
            elif after != use:
                ops.append(put_op(ADDRS + addr, after.to_json()))
        if claim is None:
            ops.append(delete_op(CLAIMS + name))
        elif old is None or claim != old:
            ops.append(put_op(CLAIMS + name, claim.to_json()))
        if ops and not (await self.etcd.txn(compare, ops)).succeeded:
            return Contended()
        if self.on_change is not None and tuple(held) != new:
            await self.on_change(name, new)
        return claim


def _check_source(pools: Sequence[Pool], name: str, source: str, field: str) -> None:
    """A pool is changed only by its own source (the API, or the Kubernetes
    watcher for a CiliumLoadBalancerIPPool)."""
    for p in pools:
        if p.name == name and p.source != source:
            raise FailedPrecondition(f"pool {name!r} is managed by {p.source}", field=field)


def _used(pool: Pool, uses: Mapping[str, AddressUse]) -> int:
    return sum(1 for a in uses if pool.contains(ipaddress.ip_address(a)))
