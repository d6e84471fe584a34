"""The policy service's logic (no gRPC here): a facade over one module per
job (allocator, ipcache, repository, trace, streams, gc) that share a local
mirror of etcd (flagella.policy.mirror), the store's transactions
(flagella.policy.store) and the node leases (flagella.policy.leases)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TypeVar

from flagella.common.sync import Batching, WatchMessages
from flagella.common.tasks import TaskGroup
from flagella.policy.allocator import Allocation, IdentityAllocator, IdentityView
from flagella.policy.fqdncache import CacheFilter, FqdnCache, Selection
from flagella.policy.gc import GarbageCollector
from flagella.policy.hostpolicy import HostPolicies, HostPolicy, Labels
from flagella.policy.ipcache import IPCache
from flagella.policy.labels import Label, LabelFilter, LabelSet
from flagella.policy.lbservices import LbServices
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.repository import RuleRepository
from flagella.policy.resolve import PolicyContent, ResolvedPolicy, SelectorUse
from flagella.policy.rules import CIDRGroup, Protocol, Rule
from flagella.policy.runtimeconfig import ConfigEvent, ConfigView, RuntimeConfig
from flagella.policy.settings import Settings
from flagella.policy.state import FqdnEntry, IdentityUse, IPEntry, PolicyState
from flagella.policy.store import PolicyStore
from flagella.policy.streams import Streams, WatchCounters
from flagella.policy.trace import Trace, resolved_policy, trace_packet

M = TypeVar("M")


class PolicyService:
    """What the servicer calls: each method hands its (validated) inputs to
    the module whose job it is."""

    def __init__(
        self,
        store: PolicyStore,
        settings: Settings | None = None,
        *,
        tasks: TaskGroup | None = None,
        lb: LbServices | None = None,
    ) -> None:
        self.store = store
        # The lb services toServices rules follow (None: no lb, toServices
        # selects nothing).
        self.lb = lb
        self.settings = settings or Settings()
        s = self.settings
        # Background work (garbage collection, lease refreshes): in the
        # runtime's group when given (the runtime stops it before the
        # service), else in one of our own.
        self.tasks = tasks or TaskGroup("policy")
        self._own_tasks = tasks is None
        self.label_filter = (
            LabelFilter(s.label_filter) if s.label_filter is not None else LabelFilter()
        )
        self.mirror = Mirror(
            store,
            lambda: PolicyState(
                budget=s.budget,
                allow_localhost=s.allow_localhost,
                k8s_ipblocks=s.k8s_ipblocks,
                services=None if lb is None else lb.infos,
            ),
            tasks=self.tasks,
            wait_timeout=s.wait_timeout,
            watch_history=s.watch_history,
        )
        self.leases = NodeLeases(
            store,
            lambda: self.mirror.state,
            self.tasks,
            ttl=s.node_lease_ttl,
            keys_per_lease=s.keys_per_lease,
        )
        self.identities = IdentityAllocator(store, self.mirror, self.leases)
        self.ipcache = IPCache(store, self.mirror, self.leases)
        self.fqdn = FqdnCache(store, self.mirror, self.leases)
        self.rules = RuleRepository(store, self.mirror)
        self.streams = Streams(self.mirror, self.leases, s)
        self.host_policies = HostPolicies(self.mirror)
        # The watch messages built (the servicer builds them: metrics).
        self.watch_counters = WatchCounters()
        self.gc = GarbageCollector(store, self.mirror, self.leases, interval=s.gc_interval)
        self.runtime_config = RuntimeConfig(
            store.etcd,
            wait_timeout=s.wait_timeout,
            heartbeat=s.watch_heartbeat,
            watch_history=s.watch_history,
        )

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    async def start(self) -> None:
        await self.mirror.start()
        self.tasks.supervise("policy-gc", self.gc.run)
        self.runtime_config.start(self.tasks)
        if self.lb is not None:
            self.lb.start(self.tasks, self.mirror.services_changed)

    async def stop(self) -> None:
        if self._own_tasks:
            await self.tasks.stop()

    # --- identities ---

    async def allocate_identity(self, labels: LabelSet, node: str, owner: str = "") -> Allocation:
        return await self.identities.allocate_identity(labels, node, owner)

    async def release_identity(self, ident: int, node: str, owner: str = "") -> bool:
        return await self.identities.release_identity(ident, node, owner)

    async def get_identity(self, ident: int) -> IdentityView:
        return await self.identities.get_identity(ident)

    async def lookup_identity(self, labels: LabelSet) -> IdentityView:
        return await self.identities.lookup_identity(labels)

    def list_identities(self, label_filter: Sequence[Label]) -> tuple[list[IdentityView], int]:
        return self.identities.list_identities(label_filter)

    # --- ipcache ---

    async def upsert_ipcache(self, entry: IPEntry) -> IPEntry:
        return await self.ipcache.upsert_ipcache(entry)

    async def delete_ipcache(self, prefix: str, expected_identity: int) -> bool:
        return await self.ipcache.delete_ipcache(prefix, expected_identity)

    def list_ipcache(self) -> tuple[list[IPEntry], int]:
        return self.ipcache.list_ipcache()

    # --- FQDN cache ---

    async def upsert_fqdn(self, node: str, entries: Sequence[FqdnEntry]) -> int:
        return await self.fqdn.upsert(node, entries)

    def fqdn_selected(self, ips: Iterable[str]) -> bool:
        """Whether some of ips has a CIDR identity now."""
        state = self.state
        return any(state.cidr_identity_of(ip) is not None for ip in ips)

    def list_fqdn(self, which: CacheFilter) -> tuple[list[FqdnEntry], int]:
        return self.fqdn.entries(which)

    async def delete_fqdn(self, which: CacheFilter) -> tuple[int, int]:
        return await self.fqdn.delete(which)

    def fqdn_selections(self) -> tuple[list[Selection], int]:
        return self.fqdn.selections()

    # --- introspection ---

    def selectors_in_use(self) -> tuple[list[SelectorUse], int]:
        state = self.state
        return state.resolver.selectors_in_use(), state.revision

    def identity_uses(self, node: str) -> tuple[list[tuple[IdentityUse, LabelSet]], int]:
        """Each identity node references, with its labels."""
        state = self.state
        out = []
        for use in state.identity_uses(node):
            info = state.info(use.identity)
            out.append((use, info.labels if info is not None else ()))
        return out, state.revision

    # --- rules ---

    async def put_rules(self, rules: Sequence[Rule]) -> tuple[list[str], int]:
        return await self.rules.put_rules(rules)

    def get_rule(self, name: str) -> Rule:
        return self.rules.get_rule(name)

    async def delete_rule(self, name: str) -> tuple[bool, int]:
        return await self.rules.delete_rule(name)

    def list_rules(self, selecting: LabelSet) -> tuple[list[Rule], int]:
        return self.rules.list_rules(selecting)

    async def put_cidr_group(self, group: CIDRGroup) -> int:
        return await self.rules.put_cidr_group(group)

    async def delete_cidr_group(self, name: str) -> tuple[bool, int]:
        return await self.rules.delete_cidr_group(name)

    def list_cidr_groups(self) -> tuple[list[CIDRGroup], int]:
        return self.rules.list_cidr_groups()

    # --- resolution ---

    def resolve(self, ident: int) -> ResolvedPolicy:
        return resolved_policy(self.state, ident)

    def trace(self, src: LabelSet, dst: LabelSet, dport: int, proto: Protocol) -> Trace:
        return trace_packet(
            self.state, src, dst, dport, proto, allow_localhost=self.settings.allow_localhost
        )

    # --- watch streams ---

    def watch_ipcache(
        self,
        since: int,
        messages: WatchMessages[str, IPEntry, M],
        batching: Batching[M] | None = None,
    ) -> AsyncIterator[M]:
        return self.streams.watch_ipcache(since, messages, batching)

    def watch_policy(
        self, node: str, since: int, messages: WatchMessages[int, PolicyContent, M]
    ) -> AsyncIterator[M]:
        return self.streams.watch_policy(node, since, messages)

    def watch_host_policy(self, node: str, labels: Labels) -> AsyncIterator[HostPolicy]:
        return self.host_policies.watch(node, labels, heartbeat=self.settings.watch_heartbeat)

    # --- runtime configuration ---

    async def get_config(self, node: str) -> ConfigView:
        return await self.runtime_config.view(node)

    async def patch_config(
        self, node: str, values: dict[str, str], reset: Sequence[str], expected_revision: int
    ) -> ConfigView:
        return await self.runtime_config.patch(node, values, reset, expected_revision)

    def watch_config(self, node: str, since: int) -> AsyncIterator[ConfigEvent]:
        return self.runtime_config.watch(node, since)

    # --- garbage collection ---

    async def collect_garbage(self) -> tuple[int, int]:
        return await self.gc.collect_garbage()
