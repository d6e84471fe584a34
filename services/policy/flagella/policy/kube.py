"""Network policy from the Kubernetes API (--kubeconfig PATH|in-cluster).

One watcher per kind: networking.k8s.io/v1 NetworkPolicy, cilium.io/v2
CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy, flagella.io/v1
FlagellaNetworkPolicy, policy.networking.k8s.io/v1alpha1 AdminNetworkPolicy
and BaselineAdminNetworkPolicy (each object a rule), and cilium.io/v2alpha1
CiliumCIDRGroup (each object a CIDR group of its name). Each follows its
kind into a table through the sync layer's KubeSource (paged list, watch
from the resourceVersion with bookmarks, relist on 410 Gone swapped in as
a diff) on every replica; only
the replica holding the watcher's Lease (flagella-policy-<plural>,
flagella.common.leader) writes, so each kind has one writer.

What the leader writes: each object's rule, translated exactly as `flagella
policy import` translates it (rules.parse_object), with the object as its
source (Rule.source; its name "<Kind>/<namespace>/<name>"). One change of
one object is one etcd transaction, conditional on the rule's revision in
the mirror (so a writer with a stale view, or a deposed leader, writes
nothing). A new term starts by comparing every object with every stored
rule of the kind: what an earlier run left is replaced, rules by hand are
never touched, and a rule equal to its object is not rewritten (a relist
writes only the difference, so enforcement never drops during one).

An object that cannot be translated is reported (a Warning Event on it
naming the field, a log line, PolicyWatcher.invalid_objects) and nothing
of it is applied: the rule of its last valid version, if any, stays
enforced (dropping it would open what it closed). The API server away:
the rules stay in etcd and are enforced; the health service name
"flagella.kubernetes" answers NOT_SERVING until every watcher has listed
again (the service itself stays SERVING: datapaths still need it).
"""

from __future__ import annotations

import abc
import asyncio
import functools
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

from flagella.common.backoff import Backoff
from flagella.common.errors import FlagellaError, InvalidArgument
from flagella.common.kubeapi import EventRecorder, api_client
from flagella.common.kubestatus import StatusReport, report_liveness
from flagella.common.leader import Election, LeaderElector
from flagella.common.outcomes import outcome_of
from flagella.common.sync import KubeSource, Table
from flagella.common.sync.dirty import DirtyKeys
from flagella.common.sync.kube import ListFunction, Obj, object_key, resource_version
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.policy.repository import RuleRepository
from flagella.policy.rules import CIDRGroup, Rule, RuleSource, compile_rule, parse_object
from flagella.policy.rules.groups import K8S_FIELDS, make_cidr_group

log = logging.getLogger(__name__)

LEASE_PREFIX = "flagella-policy-"
ADMIN_GROUP = "policy.networking.k8s.io"  # sig-network's network-policy-api
INVALID_REASON = "InvalidPolicy"
WATCH_TIMEOUT_S = 60  # the API server ends each watch call after this; we re-watch


@dataclass(frozen=True, slots=True)
class PolicyKind:
    kind: str
    group: str
    version: str
    plural: str
    # A cluster-scoped kind whose objects are CIDR groups, not rules.
    cidr_groups: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def lease(self) -> str:
        return LEASE_PREFIX + self.plural

    def rule_name(self, key: str) -> str:
        """The name of the rule of the object at key ("namespace/name"); for
        a CIDR group, the object's name (the name rules reference)."""
        namespace, _, name = key.partition("/")
        if self.cidr_groups:
            return name
        return f"{self.kind}/{namespace}/{name}" if namespace else f"{self.kind}/{name}"

    def list_function(self, api: Any) -> ListFunction:
        client: Any = importlib.import_module("kubernetes.aio.client")
        if self.group == "networking.k8s.io":
            networking = client.NetworkingV1Api(api)
            fn: ListFunction = (
                networking.list_network_policy_for_all_namespaces_without_preload_content
            )
            return fn
        custom = client.CustomObjectsApi(api)
        return functools.partial(
            custom.list_cluster_custom_object_without_preload_content,
            self.group,
            self.version,
            self.plural,
        )


# In the order of config.POLICY_KIND_NAMES.
KINDS = (
    PolicyKind("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
    PolicyKind("CiliumNetworkPolicy", "cilium.io", "v2", "ciliumnetworkpolicies"),
    PolicyKind(
        "CiliumClusterwideNetworkPolicy", "cilium.io", "v2", "ciliumclusterwidenetworkpolicies"
    ),
    PolicyKind("FlagellaNetworkPolicy", "flagella.io", "v1", "flagellanetworkpolicies"),
    PolicyKind("AdminNetworkPolicy", ADMIN_GROUP, "v1alpha1", "adminnetworkpolicies"),
    PolicyKind(
        "BaselineAdminNetworkPolicy", ADMIN_GROUP, "v1alpha1", "baselineadminnetworkpolicies"
    ),
    PolicyKind("CiliumCIDRGroup", "cilium.io", "v2alpha1", "ciliumcidrgroups", cidr_groups=True),
)


def full_object(kind: PolicyKind, obj: Obj) -> Obj:
    """obj with its apiVersion and kind (a list's items carry none)."""
    return {**obj, "apiVersion": kind.api_version, "kind": kind.kind}


def translate(kind: PolicyKind, obj: Obj, warnings: list[str] | None = None) -> Rule:
    """The rule of one object as the API gives it, with the object as its
    source. Raises InvalidArgument naming the field; appends to warnings
    what was accepted but read differently (a CIDR's host bits)."""
    key = object_key(obj)
    rule = parse_object(full_object(kind, obj), warnings=warnings)
    namespace, _, name = key.partition("/")
    rule = replace(rule, source=RuleSource(kind.kind, namespace, name))
    if rule.key != kind.rule_name(key):
        raise InvalidArgument(f"does not name {key!r}", field="metadata")
    compile_rule(rule)
    return rule


def translate_cidr_group(kind: PolicyKind, obj: Obj) -> CIDRGroup:
    """The CIDR group of a CiliumCIDRGroup. Raises InvalidArgument naming the
    field."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    cidrs = spec.get("externalCIDRs") or []
    if not isinstance(cidrs, list) or not all(isinstance(c, str) for c in cidrs):
        raise InvalidArgument("expected a list of CIDRs", field=K8S_FIELDS.cidrs)
    labels = meta.get("labels") or {}
    name = meta.get("name", "")
    source = RuleSource(kind.kind, "", name)
    return make_cidr_group(name, cidrs, labels, fields=K8S_FIELDS, source=source)


class Stored(Protocol):
    @property
    def revision(self) -> int: ...

    @property
    def source(self) -> RuleSource: ...

    def content(self) -> Any: ...


T = TypeVar("T", bound=Stored)


class ObjectWatcher(abc.ABC, Generic[T]):
    """One kind: its table of objects (every replica) and, while this
    replica leads, the sync of what they become in etcd (rules, or CIDR
    groups): the hooks below say which."""

    def __init__(
        self, kind: PolicyKind, rules: RuleRepository, events: EventRecorder | None = None
    ) -> None:
        self.kind = kind
        self.rules = rules
        self.events = events
        self.table: Table[str, Obj] = Table(f"k8s-{kind.plural}", log_size=LOCAL_LOG_SIZE)
        self.dirty = DirtyKeys()
        self.retry_backoff = Backoff(0.2, 10.0)
        self.elector: LeaderElector | None = None
        # Counters, for tests and status (metrics come later).
        self.invalid_objects = 0
        self.writes = 0
        # Set once the current term's full sync has written everything.
        self.synced = asyncio.Event()
        # The resourceVersion of each object reported invalid: one report
        # per version, however often it is looked at.
        self._reported: dict[str, str] = {}

    # --- what the objects become ---

    @abc.abstractmethod
    def held(self) -> dict[str, T]:
        """What the mirror holds, by name (of every source)."""

    @abc.abstractmethod
    def translate(self, obj: Obj, warnings: list[str]) -> T:
        """What one object becomes; raises InvalidArgument naming the field."""

    @abc.abstractmethod
    async def write(self, name: str, desired: T | None, revision: int) -> int | None:
        """Store desired (None: delete) under name if it is still at revision."""

    def stored(self) -> dict[str, T]:
        """What the mirror holds of this kind, by its object's key."""
        return {
            r.source.object_key: r for r in self.held().values() if r.source.kind == self.kind.kind
        }

    async def follow(self) -> None:
        """Mark what changes (every replica, so a new leader starts warm)."""
        async for batch in self.table.subscribe():
            self.dirty.mark(c.key for c in batch.changes)

    async def lead(self) -> None:
        """The leader's job: once the kind is listed, every object and every
        stored rule of the kind, then what changes."""
        self.synced.clear()
        self.retry_backoff.reset()
        await self.table.wait_initialized()
        self.dirty.mark({*self.table.keys(), *self.stored()})
        log.info(
            "kubernetes policy sync", extra={"kind": self.kind.kind, "objects": len(self.table)}
        )
        await self.dirty.sync_forever(self._sync, set(), self.retry_backoff, self.synced.set)

    async def _sync(self, key: str) -> bool:
        """Make the stored rule of the object at key what the object says.
        False: to be tried again (etcd away, or another writer first)."""
        name = self.kind.rule_name(key)
        obj = self.table.get(key)
        held = self.held().get(name)
        desired: T | None = None
        warnings: list[str] = []
        if obj is not None:
            try:
                desired = self.translate(obj, warnings)
            except InvalidArgument as exc:
                await self._report(key, obj, exc)
                return True
        self._reported.pop(key, None)
        if desired is None and held is None:
            return True
        if desired is not None and held is not None and desired.content() == held.content():
            return True
        try:
            written = await self.write(name, desired, held.revision if held else 0)
        except FlagellaError as exc:
            log.warning(
                "kubernetes policy not written, will retry",
                extra={"rule": name, "reason": exc.details},
            )
            return False
        if written is None:
            log.info("kubernetes policy moved meanwhile, looking again", extra={"rule": name})
            return False
        self.writes += 1
        log.info(
            "kubernetes policy " + ("applied" if desired is not None else "removed"),
            extra={"rule": name, "revision": written},
        )
        if warnings:  # e.g. an ipBlock with host bits, masked
            log.info(
                "kubernetes policy read differently than written",
                extra={"rule": name, "warnings": warnings},
            )
        return True

    async def _report(self, key: str, obj: Obj, exc: InvalidArgument) -> None:
        version = resource_version(obj)
        if self._reported.get(key) == version:
            return
        self._reported[key] = version
        self.invalid_objects += 1
        self.rules.changes.record(outcome=outcome_of(exc))
        log.warning(
            "kubernetes policy not valid, nothing applied from it",
            extra={
                "kind": self.kind.kind,
                "object": key,
                "field": exc.field,
                "reason": exc.message,
            },
        )
        if self.events is not None:
            await self.events.warning(
                full_object(self.kind, obj), INVALID_REASON, f"not enforced: {exc.details}"
            )


class PolicyWatcher(ObjectWatcher[Rule]):
    """A kind whose objects are rules."""

    def held(self) -> dict[str, Rule]:
        return self.rules.state.rules

    def translate(self, obj: Obj, warnings: list[str]) -> Rule:
        return translate(self.kind, obj, warnings)

    async def write(self, name: str, desired: Rule | None, revision: int) -> int | None:
        return await self.rules.sync_rule(name, desired, revision=revision)


class CIDRGroupWatcher(ObjectWatcher[CIDRGroup]):
    """CiliumCIDRGroup: each object the CIDR group of its name. A group put
    through the API under that name is replaced (the cluster's object is
    the source of truth) and can then only change through the object."""

    def held(self) -> dict[str, CIDRGroup]:
        return self.rules.state.cidr_groups

    def translate(self, obj: Obj, warnings: list[str]) -> CIDRGroup:
        return translate_cidr_group(self.kind, obj)

    async def write(self, name: str, desired: CIDRGroup | None, revision: int) -> int | None:
        return await self.rules.sync_cidr_group(name, desired, revision=revision)


class PolicyWatchers:
    """The watchers of a replica (one per kind), on one API client."""

    def __init__(self, rules: RuleRepository, kubeconfig: str) -> None:
        self.rules = rules
        self.kubeconfig = kubeconfig
        self.watchers: list[ObjectWatcher[Any]] = []
        self._api: Any = None

    async def start(
        self,
        tasks: TaskGroup,
        election: Election,
        *,
        report: StatusReport | None = None,
        kinds: Sequence[PolicyKind] = KINDS,
    ) -> None:
        """Raises whatever loading the kubeconfig raises."""
        self._api = await api_client(self.kubeconfig)
        events = EventRecorder(self._api, "flagella-policy", election.identity)
        for kind in kinds:
            watcher: ObjectWatcher[Any] = (
                CIDRGroupWatcher(kind, self.rules, events)
                if kind.cidr_groups
                else PolicyWatcher(kind, self.rules, events)
            )
            source = KubeSource(
                kind.plural, kind.list_function(self._api), watcher.table,
                watch_timeout=WATCH_TIMEOUT_S,
            )  # fmt: skip
            watcher.elector = election.elector(self._api, kind.lease)
            tasks.spawn(f"k8s-{kind.plural}", source.run())
            tasks.spawn(f"k8s-{kind.plural}-follow", watcher.follow())
            tasks.spawn(f"k8s-{kind.plural}-leader", watcher.elector.run(watcher.lead))
            self.watchers.append(watcher)
        if report is not None:
            tables = [(w.kind.plural, w.table) for w in self.watchers]
            tasks.spawn("k8s-status", report_liveness(tables, report))
        log.info("watching kubernetes policy", extra={"identity": election.identity})

    async def stop(self) -> None:
        """After the tasks stopped: close the client's connections."""
        if self._api is not None:
            await self._api.close()
