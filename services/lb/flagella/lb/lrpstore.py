"""etcd state of local redirect policies, under flagella/lb/v1/lrps/:

    lrps/<namespace>/<name>    the policy (JSON)

kept by an OwnedStore (ownedstore.py: create-or-replace with a compare on
what was read, delete, reads, and the table every WatchLrps stream of this
replica follows)."""

from __future__ import annotations

from flagella.common.etcd import Etcd
from flagella.common.sync.table import WATCH_LOG_SIZE
from flagella.lb.lrp import Lrp
from flagella.lb.ownedstore import OwnedStore
from flagella.lb.store import PREFIX

LRPS = PREFIX + "lrps/"


def lrp_key(namespace: str, name: str) -> str:
    return f"{LRPS}{namespace}/{name}"


class LrpStore(OwnedStore[Lrp]):
    """Every policy by namespace/name (what WatchLrps streams)."""

    def __init__(self, etcd: Etcd, *, watch_history: int = WATCH_LOG_SIZE) -> None:
        super().__init__(
            etcd,
            watch_history=watch_history,
            prefix=LRPS,
            table="lb-lrps",
            decode=Lrp.from_json,
            record_id=lambda lrp: lrp.key,
            noun="local redirect policy",
            name_field="lrp.name",
            log_key="lrp",
        )

    async def delete(self, namespace: str, name: str, source: str = "api") -> bool:
        """Delete the policy (of that source: another's is refused)."""
        return await self._delete(f"{namespace}/{name}", source)

    async def get(self, namespace: str, name: str) -> Lrp | None:
        return await self._get(f"{namespace}/{name}")

    async def list(self, namespace: str = "") -> tuple[list[Lrp], int]:
        """Every policy (of namespace), read from etcd at one revision."""
        lrps, revision = await super().list()
        return [r for r in lrps if not namespace or r.namespace == namespace], revision
