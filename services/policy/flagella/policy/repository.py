"""The rule repository: put, get, delete and list network policy rules,
and the CIDR groups rules name."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from flagella.common.errors import FailedPrecondition, NotFound
from flagella.common.outcomes import Outcomes
from flagella.policy.identities import IdentityInfo, kind_of
from flagella.policy.labels import LabelSet
from flagella.policy.mirror import Mirror
from flagella.policy.rules import CIDRGroup, Rule, compile_rule
from flagella.policy.state import PolicyState
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)


class RuleRepository:
    """Network policy rules stored in etcd, read from the mirror."""

    def __init__(self, store: PolicyStore, mirror: Mirror) -> None:
        self.store = store
        self.mirror = mirror
        # Rule changes by outcome (Cilium's policy_change_total): the API's
        # imports and deletions, and the Kubernetes watchers' objects.
        self.changes = Outcomes()

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    async def put_rules(self, rules: Sequence[Rule]) -> tuple[list[str], int]:
        """Stores rules (already validated) in one transaction."""
        for r in rules:
            compile_rule(r)
        now = time.time()
        stamped = [replace(r, updated_at=now) for r in rules]
        revision = await self.store.put_rules(stamped)
        await self.mirror.wait_for(revision)
        log.info("rules stored", extra={"rules": [r.key for r in rules], "revision": revision})
        return [r.key for r in rules], revision

    def get_rule(self, name: str) -> Rule:
        rule = self.state.rules.get(name)
        if rule is None:
            raise NotFound(f"no rule named {name!r}", field="name")
        return rule

    async def sync_rule(self, name: str, rule: Rule | None, *, revision: int) -> int | None:
        """For the Kubernetes watchers: the rule of one object (None: none
        any more) under name, in one transaction, if name is still at
        revision as the caller saw it in the mirror (0: absent). The
        revision written (visible in the mirror on return), or None when
        another writer moved it first."""
        if rule is not None:
            compile_rule(rule)
            rule = replace(rule, updated_at=time.time())
        with self.changes.counting():
            written = await self.store.sync_rule(name, rule, revision=revision)
            if written is not None:
                await self.mirror.wait_for(written)
        return written

    async def delete_rule(self, name: str) -> tuple[bool, int]:
        held = self.state.rules.get(name)
        if held is not None and held.source.kubernetes:
            src = held.source
            raise FailedPrecondition(
                f"rule {name!r} comes from the Kubernetes {src.kind} {src.object_key}: "
                "change or delete that object",
                field="name",
            )
        deleted, revision = await self.store.delete_rule(name)
        if not deleted:
            # Nothing was written: the revision may be another service's.
            return False, self.state.revision
        await self.mirror.wait_for(revision)
        return deleted, revision

    def list_rules(self, selecting: LabelSet) -> tuple[list[Rule], int]:
        state = self.state
        if selecting:
            info = IdentityInfo.make(0, selecting, kind_of(selecting))
            rules = [c.rule for c in state.resolver.rules_selecting(info)]
        else:
            rules = [state.rules[k] for k in sorted(state.rules)]
        return rules, state.revision

    # --- CIDR groups ---

    async def put_cidr_group(self, group: CIDRGroup) -> int:
        """Stores (replaces) a validated group; every rule naming it is
        resolved again with its new CIDRs once the mirror has it."""
        self._check_by_hand(group.name)
        revision = await self.store.put_cidr_group(group)
        await self.mirror.wait_for(revision)
        log.info("CIDR group stored", extra={"group": group.name, "revision": revision})
        return revision

    async def delete_cidr_group(self, name: str) -> tuple[bool, int]:
        """Rules naming a deleted group select nothing through it (never
        any peer) until it is back."""
        self._check_by_hand(name)
        deleted, revision = await self.store.delete_cidr_group(name)
        if not deleted:
            return False, self.state.revision
        await self.mirror.wait_for(revision)
        return True, revision

    async def sync_cidr_group(
        self, name: str, group: CIDRGroup | None, *, revision: int
    ) -> int | None:
        """sync_rule for the CiliumCIDRGroup watcher."""
        written = await self.store.sync_cidr_group(name, group, revision=revision)
        if written is not None:
            await self.mirror.wait_for(written)
        return written

    def _check_by_hand(self, name: str) -> None:
        held = self.state.cidr_groups.get(name)
        if held is not None and held.source.kubernetes:
            raise FailedPrecondition(
                f"CIDR group {name!r} comes from the Kubernetes {held.source.kind} "
                f"{held.source.name}: change or delete that object",
                field="name",
            )

    def list_cidr_groups(self) -> tuple[list[CIDRGroup], int]:
        state = self.state
        return [state.cidr_groups[k] for k in sorted(state.cidr_groups)], state.revision
