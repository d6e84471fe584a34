"""Logic of the policy service (no gRPC here): identities, the ipcache, the
rule repository, resolution, trace and the watch streams, on a local
mirror of etcd (flagella.policy.mirror) and etcd transactions
(flagella.policy.store)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from flagella.common.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from flagella.common.etcd import Compacted, FutureRevision, KeyValue
from flagella.policy import keys
from flagella.policy.identities import (
    MAX_GLOBAL,
    MIN_GLOBAL,
    RESERVED_NAMES,
    IdentityInfo,
    Kind,
    format_prefix,
    is_global,
    parse_prefix,
    reserved_identity_of,
    reserved_labels,
)
from flagella.policy.labels import (
    SOURCE_CIDR,
    SOURCE_RESERVED,
    Label,
    LabelFilter,
    LabelSet,
    format_labels,
    label_set,
)
from flagella.policy.mirror import Mirror
from flagella.policy.resolve import (
    DEFAULT_BUDGET,
    PolicyContent,
    ResolvedPolicy,
    trace_direction,
)
from flagella.policy.rules import (
    Direction,
    Protocol,
    Rule,
    Verdict,
    check_unique,
    compile_rule,
)
from flagella.policy.state import IPEntry, PolicyState, RefInfo
from flagella.policy.store import NodeLease, PolicyStore

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 64


@dataclass(frozen=True)
class Settings:
    node_lease_ttl: int = 900
    keys_per_lease: int = 1000
    gc_interval: float = 60.0
    budget: int = DEFAULT_BUDGET
    allow_localhost: bool = True
    label_filter: tuple[str, ...] | None = None
    watch_heartbeat: float = 30.0
    wait_timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class IdentityView:
    id: int
    labels: LabelSet
    reserved: bool
    referenced_by: tuple[str, ...] = ()
    revision: int = 0


@dataclass(frozen=True, slots=True)
class Allocation:
    identity: IdentityView
    created: bool


@dataclass(frozen=True, slots=True)
class Trace:
    verdict: Verdict
    egress: Verdict
    ingress: Verdict
    matched_rules: tuple[str, ...]
    explanation: tuple[str, ...]


class EventKind:
    RESET = "reset"
    UPSERT = "upsert"
    DELETE = "delete"
    SYNCED = "synced"


@dataclass(frozen=True, slots=True)
class IPCacheEvent:
    kind: str
    revision: int
    prefix: str = ""
    entry: IPEntry | None = None


@dataclass(frozen=True, slots=True)
class PolicyEvent:
    kind: str
    revision: int
    identity: int = 0
    policy: ResolvedPolicy | None = None


def check_node(node: str, field: str = "node") -> str:
    if not node:
        raise InvalidArgument("required", field=field)
    if not keys.NODE_RE.match(node):
        raise InvalidArgument(f"{node!r} is not a valid node name", field=field)
    return node


class NodeLeases:
    """The etcd leases a node's references and ipcache entries hang on.

    Each replica attaches new keys to its own current lease per node and
    takes a fresh one after keys_per_lease keys (etcd's cost per lease grows
    with its keys). Every lease of a node is recorded under
    nodes/<node>/<lease>, so whichever replica serves the node's WatchPolicy
    stream (or a call naming the node) keeps all of them alive: a replica
    dying loses nothing, and a node that shows no sign of life for the TTL
    loses its references."""

    def __init__(self, store: PolicyStore, mirror: Mirror, settings: Settings) -> None:
        self.store = store
        self.mirror = mirror
        self.ttl = settings.node_lease_ttl
        self.cap = settings.keys_per_lease
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self._current: dict[str, NodeLease] = {}
        self._attached: dict[int, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._refreshed: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def current_leases(self) -> set[int]:
        return {lease.lease for lease in self._current.values()}

    def _alive(self, lease: NodeLease) -> bool:
        state = self.mirror.state
        if lease.record_revision > state.revision:
            return True  # granted after what the mirror has seen
        return lease.lease in state.node_leases.get(lease.node, {})

    async def lease_for(self, node: str) -> NodeLease:
        lease = self._current.get(node)
        if (
            lease is not None
            and self._attached.get(lease.lease, 0) < self.cap
            and self._alive(lease)
        ):
            return lease
        lock = self._locks.setdefault(node, asyncio.Lock())
        async with lock:
            lease = self._current.get(node)
            if (
                lease is not None
                and self._attached.get(lease.lease, 0) < self.cap
                and self._alive(lease)
            ):
                return lease
            lease = await self.store.grant_node_lease(node, self.ttl, self.replica)
            self._current[node] = lease
            self._attached[lease.lease] = 1
            self._refreshed[node] = time.monotonic()
            log.info("node lease granted", extra={"node": node, "lease": f"{lease.lease:x}"})
            return lease

    def attached(self, lease: NodeLease) -> None:
        self._attached[lease.lease] = self._attached.get(lease.lease, 0) + 1

    def lost(self, lease: NodeLease) -> None:
        if self._current.get(lease.node) == lease:
            del self._current[lease.node]
        self._attached.pop(lease.lease, None)

    async def refresh(self, node: str) -> None:
        """Keeps every lease of node alive for another TTL."""
        self._refreshed[node] = time.monotonic()
        for lease in list(self.mirror.state.node_leases.get(node, {})):
            try:
                await self.store.keepalive(lease)
            except Unavailable as exc:
                log.warning(
                    "node lease keep-alive failed", extra={"node": node, "reason": exc.message}
                )
                return

    def touch(self, node: str) -> None:
        """A sign of life from node: refresh its leases if this replica has
        not for a third of the TTL (in the background)."""
        if time.monotonic() - self._refreshed.get(node, 0.0) < self.ttl / 3:
            return
        self._refreshed[node] = time.monotonic()
        task = asyncio.create_task(self.refresh(node), name=f"refresh-{node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def keep_alive(self, node: str) -> None:
        """While running (a WatchPolicy stream of node is open), keeps the
        node's leases alive."""
        while True:
            await self.refresh(node)
            await asyncio.sleep(max(self.ttl / 3, 0.5))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


MAX_OWNER_LEN = 512


def check_owner(owner: str) -> None:
    if len(owner) > MAX_OWNER_LEN:
        raise InvalidArgument(f"longer than {MAX_OWNER_LEN} characters", field="owner")


def _first(ranges: list[list[KeyValue]], index: int) -> KeyValue | None:
    if index < len(ranges) and ranges[index]:
        return ranges[index][0]
    return None


class PolicyService:
    def __init__(self, store: PolicyStore, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()
        s = self.settings
        self.label_filter = (
            LabelFilter(s.label_filter) if s.label_filter is not None else LabelFilter()
        )
        self.mirror = Mirror(
            store,
            lambda: PolicyState(budget=s.budget, allow_localhost=s.allow_localhost),
            wait_timeout=s.wait_timeout,
        )
        self.leases = NodeLeases(store, self.mirror, s)
        self._inflight: set[int] = set()
        self._taken: set[int] = set()
        self._gc_task: asyncio.Task[None] | None = None
        self._gc_marks: dict[int, int] = {}
        self._lease_marks: set[int] = set()

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    async def start(self) -> None:
        await self.mirror.start()
        self._gc_task = asyncio.create_task(self._gc_loop(), name="policy-gc")

    async def stop(self) -> None:
        if self._gc_task is not None:
            self._gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_task
        await self.leases.stop()
        await self.mirror.stop()

    # --- identities ---

    def identity_labels(self, labels: Iterable[Label], field: str = "labels") -> LabelSet:
        """The identity-relevant labels of a label list, validated."""
        try:
            ls = self.label_filter.filter(label_set(labels))
        except ValueError as exc:
            raise InvalidArgument(str(exc), field=field) from None
        if not ls:
            raise InvalidArgument("no identity-relevant labels", field=field)
        reserved = [lb for lb in ls if lb.source == SOURCE_RESERVED]
        if reserved and (len(ls) != 1 or reserved_identity_of(ls) is None):
            raise InvalidArgument(
                "a reserved label stands alone and names one of "
                + ", ".join(sorted(RESERVED_NAMES.values())),
                field=field,
            )
        return ls

    def _view(self, ident: int, *, revision: int = 0) -> IdentityView | None:
        state = self.state
        info = state.info(ident)
        if info is None:
            return None
        rev = revision
        if not rev and info.kind is Kind.GLOBAL:
            gid = state.identities.get(ident)
            rev = gid.mod_revision if gid else 0
        return IdentityView(
            id=ident,
            labels=info.labels,
            reserved=info.kind is not Kind.GLOBAL,
            referenced_by=tuple(state.referenced_by(ident)),
            revision=rev,
        )

    def _candidate(self) -> int:
        """A free id to try: just above the highest one in use, a little
        randomized so that replicas (and calls in flight here) rarely pick
        the same; once the top of the range is reached, the lowest free."""
        state = self.state
        known = state.identities
        if len(self._taken) > 1024:
            self._taken = {i for i in self._taken if i not in known}

        def free(ident: int) -> bool:
            return ident not in known and ident not in self._inflight and ident not in self._taken

        base = max(state.max_global_id + 1, MIN_GLOBAL)
        window = 4 + 4 * len(self._inflight)
        for ident in range(base + random.randrange(window), MAX_GLOBAL + 1):
            if free(ident):
                return ident
        for ident in range(MIN_GLOBAL, MAX_GLOBAL + 1):
            if free(ident):
                return ident
        raise ResourceExhausted(
            f"all identities {MIN_GLOBAL}-{MAX_GLOBAL} are allocated", field="labels"
        )

    async def allocate_identity(self, labels: LabelSet, node: str, owner: str = "") -> Allocation:
        """Takes a reference of node on the identity of labels, creating the
        identity if needed. Never gives one label set two ids or one id two
        label sets: labels/<labels> and id/<id> are created together only if
        both are absent. With an owner, references are per owner: an owner
        that already holds one takes no second (a retried call is a no-op)."""
        check_node(node)
        check_owner(owner)
        ls = labels
        label_string = format_labels(ls)
        reserved = reserved_identity_of(ls)
        if any(lb.source == SOURCE_CIDR for lb in ls):
            raise InvalidArgument(
                "CIDR identities are local: they come from CIDR rules", field="labels"
            )
        self.leases.touch(node)
        # What we know: from the mirror first, then from failed transactions.
        known: tuple[int, int] | None = (
            (reserved, 0) if reserved is not None else self.state.labels_index.get(label_string)
        )
        ref = _cached_ref(self.state.refs.get((label_string, node)))
        for _ in range(MAX_ATTEMPTS):
            if known is not None and ref is not None and owner and owner in ref.owners:
                # Already held by this owner: the same answer, at a revision
                # where the reference exists.
                ident = known[0]
                view = self._view(ident, revision=ref.mod_revision) or IdentityView(
                    ident, ls, reserved is not None, (node,), ref.mod_revision
                )
                return Allocation(replace(view, revision=ref.mod_revision), False)
            lease = await self.leases.lease_for(node)
            if known is None:
                ident = self._candidate()
                self._inflight.add(ident)
                try:
                    result = await self.store.create_identity(
                        ident, label_string, [str(lb) for lb in ls], lease, owner
                    )
                finally:
                    self._inflight.discard(ident)
                if result.succeeded:
                    self.leases.attached(lease)
                    await self.mirror.wait_for(result.revision)
                    log.info(
                        "identity created",
                        extra={"identity": ident, "labels": label_string, "node": node},
                    )
                    view = self._view(ident, revision=result.revision) or IdentityView(
                        ident, ls, False, (node,), result.revision
                    )
                    return Allocation(replace(view, revision=result.revision), True)
                labels_kv = _first(result.ranges, 0)
                id_kv = _first(result.ranges, 1)
                if labels_kv is not None:
                    known = (int(keys.loads(labels_kv.value)["id"]), labels_kv.mod_revision)
                    fresh = await self.store.get_reference(label_string, node)
                    ref = _ref_of(fresh)
                elif id_kv is not None:
                    self._taken.add(ident)
                else:
                    self.leases.lost(lease)
                continue
            ident, labels_revision = known
            refs = ref.refs if ref else 0
            owners = ref.owners if ref else frozenset()
            result = await self.store.set_reference(
                label_string,
                ident,
                node,
                refs + 1,
                owners=owners | {owner} if owner else owners,
                guard=lease,
                ref_revision=ref.mod_revision if ref else 0,
                lease=ref.lease if ref else 0,
                labels_revision=None if reserved is not None else labels_revision,
            )
            if result.succeeded:
                if ref is None:
                    self.leases.attached(lease)
                await self.mirror.wait_for(result.revision)
                view = self._view(ident, revision=result.revision) or IdentityView(
                    ident, ls, reserved is not None, (node,), result.revision
                )
                return Allocation(replace(view, revision=result.revision), False)
            labels_kv = _first(result.ranges, 0)
            ref_kv = _first(result.ranges, 1)
            fresh_ref = _ref_of(ref_kv)
            if reserved is None:
                if labels_kv is None:
                    known = None  # garbage-collected meanwhile: create again
                    ref = fresh_ref
                    continue
                fresh_known = (int(keys.loads(labels_kv.value)["id"]), labels_kv.mod_revision)
                if fresh_known != known:
                    known, ref = fresh_known, fresh_ref
                    continue
            if fresh_ref != ref:
                ref = fresh_ref
                continue
            self.leases.lost(lease)  # only the node's lease can have failed
        raise Unavailable("identity allocation kept conflicting; retry", field="labels")

    async def release_identity(self, ident: int, node: str, owner: str = "") -> bool:
        """Drops one reference of node (the owner's, or an anonymous one);
        True when it was the node's last. Releasing for an owner that holds
        no reference, or anonymously when only owned ones remain, does
        nothing."""
        check_node(node)
        check_owner(owner)
        if ident == 0:
            raise InvalidArgument("required", field="id")
        label_string = self._label_string_of(ident)
        if label_string is None:
            kv = await self.store.get_identity(ident) if is_global(ident) else None
            if kv is None:
                return False
            label_string = format_labels(
                label_set(Label.parse(t) for t in keys.loads(kv.value)["labels"])
            )
        ref = _cached_ref(self.state.refs.get((label_string, node)))
        if ref is None or (owner and owner not in ref.owners):
            # The mirror may lag: ask etcd before answering "not held".
            ref = _ref_of(await self.store.get_reference(label_string, node))
        for _ in range(MAX_ATTEMPTS):
            if ref is None:
                return False
            if owner and owner not in ref.owners:
                return False
            if not owner and ref.refs <= len(ref.owners):
                return False  # no anonymous reference to drop
            refs = ref.refs - 1
            result = await self.store.set_reference(
                label_string,
                ident,
                node,
                refs,
                owners=ref.owners - {owner},
                guard=None,
                ref_revision=ref.mod_revision,
                lease=ref.lease,
                labels_revision=None,
            )
            if result.succeeded:
                await self.mirror.wait_for(result.revision)
                if refs <= 0:
                    log.info("identity released by node", extra={"identity": ident, "node": node})
                return refs <= 0
            ref = _ref_of(_first(result.ranges, 1))
        raise Unavailable("identity release kept conflicting; retry", field="id")

    def _label_string_of(self, ident: int) -> str | None:
        if ident in RESERVED_NAMES:
            return format_labels(reserved_labels(ident))
        gid = self.state.identities.get(ident)
        return gid.label_string if gid else None

    async def get_identity(self, ident: int) -> IdentityView:
        view = self._view(ident)
        if view is not None:
            return view
        if is_global(ident):
            kv = await self.store.get_identity(ident)
            if kv is not None:
                await self.mirror.wait_for(kv.mod_revision)
                view = self._view(ident)
                if view is not None:
                    return view
        raise NotFound(f"identity {ident} does not exist", field="id")

    async def lookup_identity(self, labels: LabelSet) -> IdentityView:
        """By labels, without allocating: from the mirror, or etcd when the
        mirror does not know them yet."""
        ident = self.state.identity_of_labels(labels)
        if ident is None:
            kv = await self.store.get_labels(format_labels(labels))
            if kv is not None:
                await self.mirror.wait_for(kv.mod_revision)
                ident = self.state.identity_of_labels(labels)
        view = self._view(ident) if ident is not None else None
        if view is None:
            raise NotFound(f"no identity has labels {format_labels(labels)}", field="labels")
        return view

    def list_identities(self, label_filter: Sequence[Label]) -> tuple[list[IdentityView], int]:
        state = self.state
        wanted = set(label_filter)
        out = []
        for ident in sorted(state.resolver.identities):
            info = state.resolver.identities[ident]
            if wanted and not wanted.issubset(info.labels):
                continue
            view = self._view(ident)
            if view is not None:
                out.append(view)
        return out, state.revision

    # --- ipcache ---

    async def upsert_ipcache(self, entry: IPEntry) -> IPEntry:
        prefix = _prefix(entry.prefix, "entry.prefix")
        if entry.identity == 0:
            raise InvalidArgument("required", field="entry.identity")
        if self.state.info(entry.identity) is None:
            kv = (
                await self.store.get_identity(entry.identity) if is_global(entry.identity) else None
            )
            if kv is None:
                raise NotFound(f"identity {entry.identity} does not exist", field="entry.identity")
        if entry.node:
            check_node(entry.node, "entry.node")
        if entry.host_ip:
            try:
                host_ip = format_prefix(parse_prefix(entry.host_ip))
            except ValueError:
                raise InvalidArgument(
                    f"{entry.host_ip!r} is not an IP address", field="entry.host_ip"
                ) from None
            if "/" in host_ip:
                raise InvalidArgument(
                    f"{entry.host_ip!r} is not an IP address", field="entry.host_ip"
                )
        value = keys.dumps(
            {
                "identity": entry.identity,
                "node": entry.node,
                "hostIP": entry.host_ip,
                "source": entry.source or "endpoint",
            }
        )
        for _ in range(MAX_ATTEMPTS):
            lease = None
            if entry.node:
                self.leases.touch(entry.node)
                lease = await self.leases.lease_for(entry.node)
            result = await self.store.put_ip(prefix, value, lease)
            if result.succeeded:
                if lease is not None and prefix not in self.state.ip:
                    self.leases.attached(lease)
                await self.mirror.wait_for(result.revision)
                return replace(
                    entry,
                    prefix=prefix,
                    source=entry.source or "endpoint",
                    revision=result.revision,
                )
            if lease is not None:
                self.leases.lost(lease)
        raise Unavailable("ipcache update kept conflicting; retry", field="entry")

    async def delete_ipcache(self, prefix_text: str, expected_identity: int) -> bool:
        prefix = _prefix(prefix_text, "prefix")
        for _ in range(MAX_ATTEMPTS):
            kv = await self.store.get_ip(prefix)
            if kv is None:
                return False
            if expected_identity and int(keys.loads(kv.value)["identity"]) != expected_identity:
                return False
            result = await self.store.delete_ip(prefix, revision=kv.mod_revision)
            if result.succeeded:
                await self.mirror.wait_for(result.revision)
                return True
        raise Unavailable("ipcache delete kept conflicting; retry", field="prefix")

    def list_ipcache(self) -> tuple[list[IPEntry], int]:
        state = self.state
        view = state.ipcache()
        return [view[p] for p in sorted(view)], state.revision

    # --- rules ---

    async def put_rules(self, rules: Sequence[Rule]) -> tuple[list[str], int]:
        """Stores rules (already validated) in one transaction."""
        if not rules:
            raise InvalidArgument("no rules given", field="rules")
        check_unique([("", r) for r in rules])
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

    async def delete_rule(self, name: str) -> tuple[bool, int]:
        if not name:
            raise InvalidArgument("required", field="name")
        deleted, revision = await self.store.delete_rule(name)
        if not deleted:
            # Nothing was written: the revision may be another service's.
            return False, self.state.revision
        await self.mirror.wait_for(revision)
        return deleted, revision

    def list_rules(self, selecting: LabelSet) -> tuple[list[Rule], int]:
        state = self.state
        if selecting:
            info = IdentityInfo.make(0, selecting, _kind_of(selecting))
            rules = [c.rule for c in state.resolver.rules_selecting(info)]
        else:
            rules = [state.rules[k] for k in sorted(state.rules)]
        return rules, state.revision

    # --- resolution ---

    def resolve(self, ident: int) -> ResolvedPolicy:
        state = self.state
        policy = state.policy(ident)
        if policy is None:
            raise NotFound(f"identity {ident} does not exist", field="identity")
        if policy.content.error:
            raise ResourceExhausted(policy.content.error, field="identity")
        return policy

    def _trace_info(self, labels: LabelSet) -> IdentityInfo:
        state = self.state
        ident = state.identity_of_labels(labels)
        if ident is not None:
            info = state.info(ident)
            if info is not None:
                return info
        kind = _kind_of(labels)
        prefix = None
        if kind is Kind.CIDR:
            prefix = next(parse_prefix(lb.key) for lb in labels if lb.source == SOURCE_CIDR)
        return IdentityInfo.make(0, labels, kind, prefix)

    def trace(self, src: LabelSet, dst: LabelSet, dport: int, proto: Protocol) -> Trace:
        state = self.state
        if proto is Protocol.ANY:
            proto = Protocol.TCP  # a packet has a protocol: unspecified means TCP
        src_info = self._trace_info(src)
        dst_info = self._trace_info(dst)
        rules_src = state.resolver.rules_selecting(src_info)
        rules_dst = state.resolver.rules_selecting(dst_info)
        port = f"{dport}/{proto.name}" if dport else f"any/{proto.name}"
        lines = [
            f"Tracing from {format_labels(src)} (identity {src_info.id or 'none'}) to "
            f"{format_labels(dst)} (identity {dst_info.id or 'none'}) on {port}",
            f"Egress of the source: {len(rules_src)} rule(s) select it",
        ]
        allow_localhost = self.settings.allow_localhost
        egress = trace_direction(
            rules_src, Direction.EGRESS, dst_info, dport, proto, allow_localhost=allow_localhost
        )
        lines += egress.lines
        lines.append(f"Ingress of the destination: {len(rules_dst)} rule(s) select it")
        ingress = trace_direction(
            rules_dst, Direction.INGRESS, src_info, dport, proto, allow_localhost=allow_localhost
        )
        lines += ingress.lines
        allowed = egress.verdict is Verdict.ALLOW and ingress.verdict is Verdict.ALLOW
        verdict = Verdict.ALLOW if allowed else Verdict.DENY
        if allowed:
            matched = egress.deciding + ingress.deciding
        else:
            matched = [
                *(egress.deciding if egress.verdict is Verdict.DENY else []),
                *(ingress.deciding if ingress.verdict is Verdict.DENY else []),
            ]
        lines.append(f"Final verdict: {'ALLOWED' if allowed else 'DENIED'}")
        return Trace(
            verdict,
            egress.verdict,
            ingress.verdict,
            tuple(dict.fromkeys(matched)),
            tuple(lines),
        )

    # --- watch streams ---

    async def _baseline(self, since: int) -> PolicyState | None:
        """The state a client resuming from since holds, or None when it
        must start over."""
        if since <= 0:
            return None
        if since > self.state.revision:
            # The client saw a newer revision elsewhere: give this replica a
            # moment to catch up. (If nothing of ours changed up to since,
            # it never will, and need not: the diff below is exact anyway.)
            with contextlib.suppress(Unavailable):
                await self.mirror.wait_for(since, timeout=1.0)
        try:
            return await self.mirror.historic(since)
        except (Compacted, FutureRevision):
            return None

    async def watch_ipcache(self, since: int) -> AsyncIterator[IPCacheEvent]:
        sub = self.mirror.subscribe()
        try:
            baseline = await self._baseline(since)
            state = self.state
            current = state.ipcache()
            revision = state.revision
            if baseline is None:
                yield IPCacheEvent(EventKind.RESET, revision)
                for prefix in sorted(current):
                    yield IPCacheEvent(EventKind.UPSERT, revision, prefix, current[prefix])
            else:
                old = baseline.ipcache()
                for event in _ip_diff(old, current, current.keys() | old.keys(), revision):
                    yield event
            yield IPCacheEvent(EventKind.SYNCED, revision)
            sent = current
            synced = revision
            synced_at = time.monotonic()
            heartbeat = self.settings.watch_heartbeat
            while True:
                change = await sub.next(heartbeat)
                state = self.state
                if change is None:
                    if state.revision > synced:
                        synced, synced_at = state.revision, time.monotonic()
                        yield IPCacheEvent(EventKind.SYNCED, synced)
                    continue
                candidates = set(change.ipcache)
                if change.full:
                    candidates |= sent.keys() | state.ipcache().keys()
                now = {p: state.ipcache_entry(p) for p in candidates}
                events = _ip_diff(
                    sent,
                    {p: e for p, e in now.items() if e is not None},
                    candidates,
                    state.revision,
                )
                for p, e in now.items():
                    if e is None:
                        sent.pop(p, None)
                    else:
                        sent[p] = e
                for event in events:
                    yield event
                if events or time.monotonic() - synced_at >= heartbeat:
                    synced, synced_at = state.revision, time.monotonic()
                    yield IPCacheEvent(EventKind.SYNCED, synced)
        finally:
            sub.close()

    async def watch_policy(self, node: str, since: int) -> AsyncIterator[PolicyEvent]:
        check_node(node)
        sub = self.mirror.subscribe()
        keeper = asyncio.create_task(self.leases.keep_alive(node), name=f"keepalive-{node}")
        try:
            baseline = await self._baseline(since)
            state = self.state
            current = state.node_policies(node)
            revision = state.revision
            if baseline is None:
                yield PolicyEvent(EventKind.RESET, revision)
                for ident in sorted(current):
                    yield _policy_upsert(ident, revision, current[ident])
            else:
                old = baseline.node_policies(node)
                for event in _policy_diff(old, current, old.keys() | current.keys(), revision):
                    yield event
            yield PolicyEvent(EventKind.SYNCED, revision)
            sent = current
            synced = revision
            synced_at = time.monotonic()
            heartbeat = self.settings.watch_heartbeat
            while True:
                change = await sub.next(heartbeat)
                state = self.state
                if change is None:
                    if state.revision > synced:
                        synced, synced_at = state.revision, time.monotonic()
                        yield PolicyEvent(EventKind.SYNCED, synced)
                    continue
                on_node = state.node_refs.get(node, {})
                if change.full:
                    candidates = set(sent) | set(on_node)
                else:
                    candidates = set(change.nodes.get(node, ()))
                    dirty = change.dirty
                    if len(dirty) <= len(sent) + len(on_node):
                        candidates |= {i for i in dirty if i in sent or i in on_node}
                    else:
                        candidates |= {i for i in (*sent, *on_node) if i in dirty}
                now: dict[int, PolicyContent] = {}
                for ident in candidates:
                    if ident in on_node:
                        content = state.resolver.content(ident)
                        if content is not None:
                            now[ident] = content
                events = _policy_diff(
                    {i: sent[i] for i in candidates if i in sent}, now, candidates, state.revision
                )
                for ident in candidates:
                    if ident in now:
                        sent[ident] = now[ident]
                    else:
                        sent.pop(ident, None)
                for event in events:
                    yield event
                # A SYNCED also after a change of the node's references with
                # nothing to send (a reference count went up): whoever waits
                # for the revision of an allocation sees it.
                if events or node in change.nodes or time.monotonic() - synced_at >= heartbeat:
                    synced, synced_at = state.revision, time.monotonic()
                    yield PolicyEvent(EventKind.SYNCED, synced)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            sub.close()

    # --- garbage collection ---

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gc_interval * random.uniform(0.9, 1.1))
            try:
                await self.collect_garbage()
            except Unavailable as exc:
                log.warning("garbage collection failed", extra={"reason": exc.message})

    async def collect_garbage(self) -> tuple[int, int]:
        """One round: frees identities no node referenced in this round and
        the last, and revokes node leases that held nothing but their
        record in both. Returns (identities freed, leases revoked)."""
        state = self.state
        freed = 0
        marks: dict[int, int] = {}
        for gid in state.unreferenced_identities():
            marks[gid.id] = gid.mod_revision
            if self._gc_marks.get(gid.id) != gid.mod_revision:
                continue
            index = state.labels_index.get(gid.label_string)
            if index is None or index[0] != gid.id:
                continue
            if await self.store.delete_identity(
                gid.id, gid.label_string, id_revision=gid.mod_revision, labels_revision=index[1]
            ):
                freed += 1
                log.info(
                    "identity garbage-collected",
                    extra={"identity": gid.id, "labels": gid.label_string},
                )
        self._gc_marks = marks
        revoked = 0
        mine = self.leases.current_leases()
        empty = {
            lease
            for leases in state.node_leases.values()
            for lease in leases
            if state.lease_keys.get(lease, 0) <= 1 and lease not in mine
        }
        for lease in empty & self._lease_marks:
            await self.store.revoke(lease)
            revoked += 1
        self._lease_marks = empty - self._lease_marks
        return freed, revoked


class Ref(NamedTuple):
    """A node's references on an identity, as etcd holds them."""

    mod_revision: int
    refs: int
    lease: int
    owners: frozenset[str]


def _ref_of(kv: KeyValue | None) -> Ref | None:
    if kv is None:
        return None
    value = keys.loads(kv.value)
    return Ref(kv.mod_revision, int(value["refs"]), kv.lease, frozenset(value.get("owners", ())))


def _cached_ref(cached: RefInfo | None) -> Ref | None:
    if cached is None:
        return None
    return Ref(cached.mod_revision, cached.refs, cached.lease, cached.owners)


def _prefix(text: str, field: str) -> str:
    if not text:
        raise InvalidArgument("required", field=field)
    try:
        return format_prefix(parse_prefix(text))
    except ValueError as exc:
        raise InvalidArgument(f"{text!r} is not an IP or CIDR ({exc})", field=field) from None


def _kind_of(labels: LabelSet) -> Kind:
    if reserved_identity_of(labels) is not None:
        return Kind.RESERVED
    if any(lb.source == SOURCE_CIDR for lb in labels):
        return Kind.CIDR
    return Kind.GLOBAL


def _ip_diff(
    old: dict[str, IPEntry], new: dict[str, IPEntry], candidates: Iterable[str], revision: int
) -> list[IPCacheEvent]:
    events = []
    for prefix in sorted(candidates):
        before, after = old.get(prefix), new.get(prefix)
        if after is None:
            if before is not None:
                events.append(IPCacheEvent(EventKind.DELETE, revision, prefix))
        elif after != before:
            events.append(IPCacheEvent(EventKind.UPSERT, revision, prefix, after))
    return events


def _policy_upsert(ident: int, revision: int, content: PolicyContent) -> PolicyEvent:
    return PolicyEvent(EventKind.UPSERT, revision, ident, ResolvedPolicy(ident, revision, content))


def _policy_diff(
    old: dict[int, PolicyContent],
    new: dict[int, PolicyContent],
    candidates: Iterable[int],
    revision: int,
) -> list[PolicyEvent]:
    events = []
    for ident in sorted(candidates):
        before, after = old.get(ident), new.get(ident)
        if after is None:
            if before is not None:
                events.append(PolicyEvent(EventKind.DELETE, revision, ident))
        elif before is None or (before is not after and before != after):
            events.append(_policy_upsert(ident, revision, after))
    return events
