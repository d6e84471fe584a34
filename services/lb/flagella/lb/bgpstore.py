"""etcd state of BGP peering policies, under flagella/lb/v1/bgp/:

    bgp/policies/<name>    the policy (JSON, neighbours' passwords included:
                           only the lb's etcd user reads this prefix)

kept by an OwnedStore (ownedstore.py: create-or-replace with a compare on
what was read, delete, the listing, and the table every
WatchBgpPeeringPolicies stream of this replica follows)."""

from __future__ import annotations

from flagella.common.etcd import Etcd
from flagella.common.sync.table import WATCH_LOG_SIZE
from flagella.lb.bgp import PeeringPolicy
from flagella.lb.ownedstore import OwnedStore
from flagella.lb.store import PREFIX

POLICIES = PREFIX + "bgp/policies/"


def policy_key(name: str) -> str:
    return f"{POLICIES}{name}"


class BgpPolicyStore(OwnedStore[PeeringPolicy]):
    def __init__(self, etcd: Etcd, *, watch_history: int = WATCH_LOG_SIZE) -> None:
        super().__init__(
            etcd,
            watch_history=watch_history,
            prefix=POLICIES,
            table="lb-bgp-policies",
            decode=PeeringPolicy.from_json,
            record_id=lambda p: p.name,
            noun="BGP peering policy",
            name_field="policy.name",
            log_key="policy",
        )

    async def delete(self, name: str, source: str = "api") -> bool:
        """Delete the policy (of that source: another's is refused)."""
        return await self._delete(name, source)
