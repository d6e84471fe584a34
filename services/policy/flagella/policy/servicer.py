"""gRPC handlers of flagella.policy.v1: proto <-> domain and validation
(flagella.policy.validation). The logic is in flagella.policy.service."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc
from flagella.common.errors import InvalidArgument
from flagella.policy.allocator import IdentityView
from flagella.policy.labels import Label, LabelError, LabelSet, label_set, split_label
from flagella.policy.resolve import PolicyContent, PolicyEntry, ResolvedPolicy
from flagella.policy.rules import (
    CIDRSpec,
    Expression,
    PeerSpec,
    PortSpec,
    Protocol,
    Rule,
    SelectorSpec,
    check_cidr,
    check_name,
    check_namespace,
    check_port,
    check_selector,
    parse_document,
)
from flagella.policy.selector import Entity
from flagella.policy.service import PolicyService
from flagella.policy.state import IPEntry
from flagella.policy.streams import EventKind, IPCacheEvent, PolicyEvent
from flagella.policy.validation import (
    check_allocatable,
    check_ip_entry,
    check_node,
    check_owner,
    check_prefix,
    check_rules,
    identity_labels,
    lookup_labels,
)

Ctx = Any

_EVENT_KINDS = {
    EventKind.RESET: pb.EVENT_KIND_RESET,
    EventKind.UPSERT: pb.EVENT_KIND_UPSERT,
    EventKind.DELETE: pb.EVENT_KIND_DELETE,
    EventKind.SYNCED: pb.EVENT_KIND_SYNCED,
}
_OPERATORS = {
    pb.LabelSelectorRequirement.OPERATOR_IN: "In",
    pb.LabelSelectorRequirement.OPERATOR_NOT_IN: "NotIn",
    pb.LabelSelectorRequirement.OPERATOR_EXISTS: "Exists",
    pb.LabelSelectorRequirement.OPERATOR_DOES_NOT_EXIST: "DoesNotExist",
}
_OPERATOR_PB = {v: k for k, v in _OPERATORS.items()}
_ENTITIES = {
    pb.ENTITY_ALL: Entity.ALL,
    pb.ENTITY_WORLD: Entity.WORLD,
    pb.ENTITY_CLUSTER: Entity.CLUSTER,
    pb.ENTITY_HOST: Entity.HOST,
    pb.ENTITY_REMOTE_NODE: Entity.REMOTE_NODE,
    pb.ENTITY_INIT: Entity.INIT,
    pb.ENTITY_HEALTH: Entity.HEALTH,
    pb.ENTITY_UNMANAGED: Entity.UNMANAGED,
}
_ENTITY_PB = {v: k for k, v in _ENTITIES.items()}
_PROTOCOLS = {int(p): p for p in Protocol}


# --- labels and identities ---


def labels_from_pb(labels: Sequence[pb.Label], field: str) -> list[Label]:
    out = []
    for i, label in enumerate(labels):
        source, key = label.source, label.key
        if not source:
            source, key, _ = split_label(key)
        try:
            out.append(Label.make(source, key, label.value))
        except LabelError as exc:
            raise InvalidArgument(str(exc), field=f"{field}[{i}]") from None
    return out


def label_pb(label: Label) -> pb.Label:
    return pb.Label(source=label.source, key=label.key, value=label.value)


def identity_pb(view: IdentityView) -> pb.Identity:
    return pb.Identity(
        id=view.id,
        labels=[label_pb(lb) for lb in view.labels],
        reserved=view.reserved,
        referenced_by=list(view.referenced_by),
        revision=view.revision,
    )


# --- rules ---


def _selector_from_pb(sel: pb.EndpointSelector, path: str) -> SelectorSpec:
    exprs = []
    for i, e in enumerate(sel.match_expressions):
        if e.operator not in _OPERATORS:
            raise InvalidArgument(
                "operator is required (In, NotIn, Exists, DoesNotExist)",
                field=f"{path}.match_expressions[{i}].operator",
            )
        exprs.append(Expression(e.key, _OPERATORS[e.operator], tuple(e.values)))
    spec = SelectorSpec(tuple(sorted(sel.match_labels.items())), tuple(exprs))
    check_selector(spec, path, labels_path="match_labels", exprs_path="match_expressions")
    return spec


def _peer_from_pb(peer: pb.PeerRule, path: str) -> PeerSpec:
    endpoints = tuple(
        _selector_from_pb(s, f"{path}.endpoints[{i}]") for i, s in enumerate(peer.endpoints)
    )
    cidrs = []
    for i, c in enumerate(peer.cidrs):
        spec = CIDRSpec(c.cidr, tuple(getattr(c, "except")))
        check_cidr(spec, f"{path}.cidrs[{i}]", cidr_field="cidr", except_field="except")
        cidrs.append(spec)
    entities = []
    for i, e in enumerate(peer.entities):
        if e not in _ENTITIES:
            raise InvalidArgument("unknown entity", field=f"{path}.entities[{i}]")
        entities.append(_ENTITIES[e])
    to_ports = []
    for i, pr in enumerate(peer.to_ports):
        ports = []
        for j, p in enumerate(pr.ports):
            pp = f"{path}.to_ports[{i}].ports[{j}]"
            if p.protocol not in _PROTOCOLS:
                raise InvalidArgument("unknown protocol", field=f"{pp}.protocol")
            spec_p = PortSpec(p.port, p.end_port, _PROTOCOLS[p.protocol])
            check_port(spec_p, pp, end_field="end_port")
            ports.append(spec_p)
        to_ports.append(tuple(ports))
    return PeerSpec(endpoints, tuple(cidrs), tuple(entities), tuple(to_ports))


def rule_from_pb(rule: pb.Rule, path: str) -> Rule:
    name, namespace = rule.name, rule.namespace
    if "/" in name:
        ns, _, name = name.partition("/")
        if namespace and namespace != ns:
            raise InvalidArgument(
                f"name says namespace {ns!r}, namespace says {namespace!r}", field=f"{path}.name"
            )
        namespace = ns
    check_name(name, f"{path}.name")
    check_namespace(namespace, f"{path}.namespace")
    if not rule.HasField("endpoint_selector"):
        raise InvalidArgument("required", field=f"{path}.endpoint_selector")

    def peers(items: Sequence[pb.PeerRule], fld: str) -> tuple[PeerSpec, ...]:
        return tuple(_peer_from_pb(p, f"{path}.{fld}[{i}]") for i, p in enumerate(items))

    return Rule(
        name=name,
        namespace=namespace,
        endpoint_selector=_selector_from_pb(rule.endpoint_selector, f"{path}.endpoint_selector"),
        ingress=peers(rule.ingress, "ingress"),
        ingress_deny=peers(rule.ingress_deny, "ingress_deny"),
        egress=peers(rule.egress, "egress"),
        egress_deny=peers(rule.egress_deny, "egress_deny"),
        enforce_ingress=rule.enforce_ingress,
        enforce_egress=rule.enforce_egress,
        description=rule.description,
        labels=tuple(sorted(rule.labels.items())),
    )


def _selector_pb(spec: SelectorSpec) -> pb.EndpointSelector:
    return pb.EndpointSelector(
        match_labels=dict(spec.match_labels),
        match_expressions=[
            pb.LabelSelectorRequirement(
                key=e.key, operator=_OPERATOR_PB[e.operator], values=list(e.values)
            )
            for e in spec.match_expressions
        ],
    )


def _cidr_pb(c: CIDRSpec) -> pb.CIDRRule:
    out = pb.CIDRRule(cidr=c.cidr)
    getattr(out, "except").extend(c.excepts)  # "except" is a Python keyword
    return out


def _peer_pb(peer: PeerSpec) -> pb.PeerRule:
    return pb.PeerRule(
        endpoints=[_selector_pb(s) for s in peer.endpoints],
        cidrs=[_cidr_pb(c) for c in peer.cidrs],
        entities=[_ENTITY_PB[e] for e in peer.entities],
        to_ports=[
            pb.PortRule(
                ports=[
                    pb.PortProtocol(port=p.port, end_port=p.end_port, protocol=int(p.protocol))  # type: ignore[arg-type]
                    for p in pr
                ]
            )
            for pr in peer.to_ports
        ],
    )


def rule_pb(rule: Rule) -> pb.Rule:
    updated = Timestamp()
    if rule.updated_at:
        updated.FromNanoseconds(int(rule.updated_at * 1e9))
    return pb.Rule(
        name=rule.key,
        namespace=rule.namespace,
        endpoint_selector=_selector_pb(rule.endpoint_selector),
        ingress=[_peer_pb(p) for p in rule.ingress],
        ingress_deny=[_peer_pb(p) for p in rule.ingress_deny],
        egress=[_peer_pb(p) for p in rule.egress],
        egress_deny=[_peer_pb(p) for p in rule.egress_deny],
        enforce_ingress=rule.enforce_ingress,
        enforce_egress=rule.enforce_egress,
        description=rule.description,
        labels=dict(rule.labels),
        revision=rule.revision,
        updated_at=updated if rule.updated_at else None,
    )


# --- policies and the ipcache ---


def _entry_pb(e: PolicyEntry) -> pb.PolicyEntry:
    return pb.PolicyEntry(
        identity=e.identity,
        port=e.port,
        end_port=e.end_port,
        protocol=int(e.protocol),  # type: ignore[arg-type]
        direction=int(e.direction),  # type: ignore[arg-type]
        verdict=int(e.verdict),  # type: ignore[arg-type]
        derived_from=e.derived_from,
    )


def content_bytes(c: PolicyContent) -> bytes:
    """A ResolvedPolicy without identity and revision, serialized."""
    return pb.ResolvedPolicy(
        ingress_enforced=c.ingress_enforced,
        egress_enforced=c.egress_enforced,
        entries=[_entry_pb(e) for e in c.entries],
        error=c.error,
    ).SerializeToString()


class ContentCache:
    """Serialized policy contents by content object: identities that share
    a signature share one content, so each is encoded once. Holds the
    content it caches (so its id is not reused while cached)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._cache: OrderedDict[int, tuple[PolicyContent, bytes]] = OrderedDict()

    def get(self, c: PolicyContent) -> bytes:
        hit = self._cache.get(id(c))
        if hit is not None and hit[0] is c:
            self._cache.move_to_end(id(c))
            return hit[1]
        raw = content_bytes(c)
        self._cache[id(c)] = (c, raw)
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return raw


def policy_pb(policy: ResolvedPolicy, cache: ContentCache | None = None) -> pb.ResolvedPolicy:
    c = policy.content
    raw = cache.get(c) if cache is not None else content_bytes(c)
    out = pb.ResolvedPolicy.FromString(raw)
    out.identity = policy.identity
    out.revision = policy.revision
    return out


def ip_entry_pb(e: IPEntry) -> pb.IPCacheEntry:
    return pb.IPCacheEntry(
        prefix=e.prefix,
        identity=e.identity,
        node=e.node,
        host_ip=e.host_ip,
        source=e.source,
        revision=e.revision,
    )


def ip_event_pb(ev: IPCacheEvent) -> pb.IPCacheEvent:
    out = pb.IPCacheEvent(kind=_EVENT_KINDS[ev.kind], revision=ev.revision)
    if ev.entry is not None:
        out.entry.CopyFrom(ip_entry_pb(ev.entry))
    elif ev.prefix:
        out.entry.prefix = ev.prefix
    return out


def policy_event_pb(ev: PolicyEvent, cache: ContentCache | None = None) -> pb.PolicyEvent:
    out = pb.PolicyEvent(kind=_EVENT_KINDS[ev.kind], identity=ev.identity, revision=ev.revision)
    if ev.policy is not None:
        c = ev.policy.content
        out.policy.MergeFromString(cache.get(c) if cache is not None else content_bytes(c))
        out.policy.identity = ev.policy.identity
        out.policy.revision = ev.policy.revision
    return out


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    def __init__(self, service: PolicyService) -> None:
        self.service = service
        self.contents = ContentCache()

    # --- identities ---

    async def AllocateIdentity(
        self, request: pb.AllocateIdentityRequest, context: Ctx
    ) -> pb.AllocateIdentityResponse:
        labels = identity_labels(
            labels_from_pb(request.labels, "labels"), self.service.label_filter
        )
        check_node(request.node)
        check_owner(request.owner)
        check_allocatable(labels)
        alloc = await self.service.allocate_identity(labels, request.node, request.owner)
        return pb.AllocateIdentityResponse(
            identity=identity_pb(alloc.identity), created=alloc.created
        )

    async def ReleaseIdentity(
        self, request: pb.ReleaseIdentityRequest, context: Ctx
    ) -> pb.ReleaseIdentityResponse:
        check_node(request.node)
        check_owner(request.owner)
        if request.id == 0:
            raise InvalidArgument("required", field="id")
        released = await self.service.release_identity(request.id, request.node, request.owner)
        return pb.ReleaseIdentityResponse(released=released)

    async def GetIdentity(self, request: pb.GetIdentityRequest, context: Ctx) -> pb.Identity:
        which = request.WhichOneof("by")
        if which == "id":
            if request.id == 0:
                raise InvalidArgument("required", field="id")
            return identity_pb(await self.service.get_identity(request.id))
        if which == "labels":
            labels = self._lookup_labels(request.labels.labels, "labels.labels")
            return identity_pb(await self.service.lookup_identity(labels))
        raise InvalidArgument("give an id or labels", field="by")

    def _lookup_labels(self, labels: Sequence[pb.Label], field: str) -> LabelSet:
        return lookup_labels(labels_from_pb(labels, field), self.service.label_filter, field)

    async def ListIdentities(
        self, request: pb.ListIdentitiesRequest, context: Ctx
    ) -> pb.ListIdentitiesResponse:
        wanted = labels_from_pb(request.label_filter, "label_filter")
        views, revision = self.service.list_identities(wanted)
        return pb.ListIdentitiesResponse(
            identities=[identity_pb(v) for v in views], revision=revision
        )

    # --- ipcache ---

    async def UpsertIPCache(
        self, request: pb.UpsertIPCacheRequest, context: Ctx
    ) -> pb.UpsertIPCacheResponse:
        if not request.HasField("entry"):
            raise InvalidArgument("required", field="entry")
        e = request.entry
        entry = check_ip_entry(IPEntry(e.prefix, e.identity, e.node, e.host_ip, e.source))
        stored = await self.service.upsert_ipcache(entry)
        return pb.UpsertIPCacheResponse(entry=ip_entry_pb(stored))

    async def DeleteIPCache(
        self, request: pb.DeleteIPCacheRequest, context: Ctx
    ) -> pb.DeleteIPCacheResponse:
        prefix = check_prefix(request.prefix, "prefix")
        deleted = await self.service.delete_ipcache(prefix, request.expected_identity)
        return pb.DeleteIPCacheResponse(deleted=deleted)

    async def ListIPCache(
        self, request: pb.ListIPCacheRequest, context: Ctx
    ) -> pb.ListIPCacheResponse:
        entries, revision = self.service.list_ipcache()
        return pb.ListIPCacheResponse(entries=[ip_entry_pb(e) for e in entries], revision=revision)

    async def WatchIPCache(
        self, request: pb.WatchIPCacheRequest, context: Ctx
    ) -> AsyncIterator[pb.IPCacheEvent]:
        if request.since_revision < 0:
            raise InvalidArgument("must not be negative", field="since_revision")
        async for event in self.service.watch_ipcache(request.since_revision):
            yield ip_event_pb(event)

    # --- rules ---

    async def PutRules(self, request: pb.PutRulesRequest, context: Ctx) -> pb.PutRulesResponse:
        which = request.WhichOneof("source")
        if which == "rules":
            rules = [
                rule_from_pb(r, f"rules.rules[{i}]") for i, r in enumerate(request.rules.rules)
            ]
        elif which == "document":
            rules = parse_document(request.document)
        else:
            raise InvalidArgument("give rules or a document", field="source")
        names, revision = await self.service.put_rules(check_rules(rules))
        return pb.PutRulesResponse(names=names, revision=revision)

    async def GetRule(self, request: pb.GetRuleRequest, context: Ctx) -> pb.Rule:
        if not request.name:
            raise InvalidArgument("required", field="name")
        return rule_pb(self.service.get_rule(request.name))

    async def DeleteRule(
        self, request: pb.DeleteRuleRequest, context: Ctx
    ) -> pb.DeleteRuleResponse:
        if not request.name:
            raise InvalidArgument("required", field="name")
        deleted, revision = await self.service.delete_rule(request.name)
        return pb.DeleteRuleResponse(deleted=deleted, revision=revision)

    async def ListRules(self, request: pb.ListRulesRequest, context: Ctx) -> pb.ListRulesResponse:
        selecting: LabelSet = ()
        if request.selecting:
            try:
                selecting = label_set(labels_from_pb(request.selecting, "selecting"))
            except LabelError as exc:
                raise InvalidArgument(str(exc), field="selecting") from None
        rules, revision = self.service.list_rules(selecting)
        return pb.ListRulesResponse(rules=[rule_pb(r) for r in rules], revision=revision)

    # --- resolution ---

    async def ResolvePolicy(
        self, request: pb.ResolvePolicyRequest, context: Ctx
    ) -> pb.ResolvedPolicy:
        if request.identity == 0:
            raise InvalidArgument("required", field="identity")
        return policy_pb(self.service.resolve(request.identity), self.contents)

    async def TracePolicy(
        self, request: pb.TracePolicyRequest, context: Ctx
    ) -> pb.TracePolicyResponse:
        src = self._lookup_labels(request.src_labels, "src_labels")
        dst = self._lookup_labels(request.dst_labels, "dst_labels")
        if request.dport > 65535:
            raise InvalidArgument(f"port {request.dport} out of range (0-65535)", field="dport")
        if request.protocol not in _PROTOCOLS:
            raise InvalidArgument("unknown protocol", field="protocol")
        trace = self.service.trace(src, dst, request.dport, _PROTOCOLS[request.protocol])
        return pb.TracePolicyResponse(
            verdict=int(trace.verdict),  # type: ignore[arg-type]
            egress_verdict=int(trace.egress),  # type: ignore[arg-type]
            ingress_verdict=int(trace.ingress),  # type: ignore[arg-type]
            matched_rules=list(trace.matched_rules),
            explanation=list(trace.explanation),
        )

    async def WatchPolicy(
        self, request: pb.WatchPolicyRequest, context: Ctx
    ) -> AsyncIterator[pb.PolicyEvent]:
        if request.since_revision < 0:
            raise InvalidArgument("must not be negative", field="since_revision")
        check_node(request.node)
        async for event in self.service.watch_policy(request.node, request.since_revision):
            yield policy_event_pb(event, self.contents)
