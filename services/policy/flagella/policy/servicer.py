"""gRPC handlers of flagella.policy.v1: proto <-> domain (flagella.policy.convert)
and validation (flagella.policy.validation). The logic is in
flagella.policy.service."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc
from flagella.common.debuginfo import Debuginfo, answer
from flagella.common.errors import InvalidArgument
from flagella.common.portnames import protocol_name
from flagella.common.sync import MessageCache
from flagella.policy.convert import (
    IPCACHE_BATCHING,
    PROTOCOLS,
    ContentCache,
    IPCacheMessages,
    PolicyMessages,
    cidr_group_from_pb,
    cidr_group_pb,
    config_event_pb,
    config_pb,
    fqdn_entry_from_pb,
    fqdn_entry_pb,
    fqdn_selection_pb,
    host_policy_event_pb,
    identity_pb,
    ip_entry_pb,
    ipcache_slot,
    label_pb,
    labels_from_pb,
    policy_pb,
    policy_slot,
    rule_from_pb,
    rule_pb,
)
from flagella.policy.fqdncache import CacheFilter
from flagella.policy.hostpolicy import host_info
from flagella.policy.labels import LabelError, LabelSet, label_set
from flagella.policy.rules import ICMP_PROTOCOLS, icmp_port, parse_document
from flagella.policy.rules.fqdn import check_pattern
from flagella.policy.service import PolicyService
from flagella.policy.state import FqdnEntry, IPEntry
from flagella.policy.validation import (
    MAX_FQDN_ENTRIES,
    check_allocatable,
    check_fqdn_endpoint,
    check_ip_entry,
    check_key,
    check_node,
    check_owner,
    check_prefix,
    check_rules,
    identity_labels,
    lookup_labels,
)

Ctx = Any


def _cache_filter(node: str, endpoint: str, pattern: str, cidr: str) -> CacheFilter:
    """A list's or delete's filter (validated; empty fields match all)."""
    if node:
        check_node(node)
    if endpoint:
        check_fqdn_endpoint(endpoint, "endpoint")
    net = None
    if cidr:
        try:
            net = ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise InvalidArgument(f"{cidr!r} is not a CIDR", field="cidr") from None
    return CacheFilter(
        node=node,
        endpoint=endpoint,
        pattern=check_pattern(pattern, "match_pattern") if pattern else "",
        cidr=net,
    )


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    def __init__(self, service: PolicyService, debuginfo: Debuginfo | None = None) -> None:
        self.service = service
        self.debuginfo = debuginfo
        self.contents = ContentCache()
        # The watch streams' UPSERT messages, shared by every stream: each
        # prefix's and each identity's newest.
        self.ipcache_events: MessageCache[Any, pb.IPCacheEvent] = MessageCache(
            8 << 20, slot=ipcache_slot
        )
        self.policy_events: MessageCache[Any, pb.PolicyEvent] = MessageCache(
            8 << 20, slot=policy_slot
        )

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
        entry = check_ip_entry(
            IPEntry(e.prefix, e.identity, e.node, e.host_ip, e.source),
            [(p.name, p.port, protocol_name(p.protocol)) for p in e.named_ports],
        )
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
        messages = IPCacheMessages(self.ipcache_events, self.service.watch_counters)
        batching = IPCACHE_BATCHING if request.batch_events else None
        async for event in self.service.watch_ipcache(request.since_revision, messages, batching):
            yield event

    # --- FQDN cache ---

    async def UpsertFQDNCache(
        self, request: pb.UpsertFQDNCacheRequest, context: Ctx
    ) -> pb.UpsertFQDNCacheResponse:
        node = check_node(request.node)
        if not request.entries:
            raise InvalidArgument("required", field="entries")
        if len(request.entries) > MAX_FQDN_ENTRIES:
            raise InvalidArgument(
                f"{len(request.entries)} entries; at most {MAX_FQDN_ENTRIES}", field="entries"
            )
        now = time.time()
        entries: dict[tuple[str, str, str], FqdnEntry] = {}
        for i, e in enumerate(request.entries):
            entry = fqdn_entry_from_pb(e, node, f"entries[{i}]", now)
            if entry.where in entries:
                raise InvalidArgument(
                    f"endpoint {entry.endpoint!r} and name {entry.name!r} given twice",
                    field=f"entries[{i}]",
                )
            entries[entry.where] = entry
        revision = await self.service.upsert_fqdn(node, list(entries.values()))
        selected = self.service.fqdn_selected(ip for e in entries.values() for ip in e.ips)
        return pb.UpsertFQDNCacheResponse(revision=revision, selected=selected)

    async def ListFQDNCache(
        self, request: pb.ListFQDNCacheRequest, context: Ctx
    ) -> pb.ListFQDNCacheResponse:
        which = _cache_filter(request.node, request.endpoint, request.match_pattern, request.cidr)
        entries, revision = self.service.list_fqdn(which)
        return pb.ListFQDNCacheResponse(
            entries=[fqdn_entry_pb(e) for e in entries], revision=revision
        )

    async def DeleteFQDNCache(
        self, request: pb.DeleteFQDNCacheRequest, context: Ctx
    ) -> pb.DeleteFQDNCacheResponse:
        if not (request.node or request.match_pattern):
            raise InvalidArgument(
                'give a node or a pattern ("*" for every name)', field="match_pattern"
            )
        which = _cache_filter(request.node, request.endpoint, request.match_pattern, "")
        deleted, revision = await self.service.delete_fqdn(which)
        return pb.DeleteFQDNCacheResponse(deleted=deleted, revision=revision)

    async def ListFQDNSelectors(
        self, request: pb.ListFQDNSelectorsRequest, context: Ctx
    ) -> pb.ListFQDNSelectorsResponse:
        selections, revision = self.service.fqdn_selections()
        return pb.ListFQDNSelectorsResponse(
            selections=[fqdn_selection_pb(s) for s in selections], revision=revision
        )

    # --- introspection ---

    async def GetPolicySelectors(
        self, request: pb.GetPolicySelectorsRequest, context: Ctx
    ) -> pb.GetPolicySelectorsResponse:
        uses, revision = self.service.selectors_in_use()
        return pb.GetPolicySelectorsResponse(
            selectors=[
                pb.PolicySelector(
                    selector=u.selector, role=u.role, identities=u.identities, rules=u.rules
                )
                for u in uses
            ],
            revision=revision,
        )

    async def GetIdentityEndpoints(
        self, request: pb.GetIdentityEndpointsRequest, context: Ctx
    ) -> pb.GetIdentityEndpointsResponse:
        if request.node:
            check_node(request.node)
        uses, revision = self.service.identity_uses(request.node)
        return pb.GetIdentityEndpointsResponse(
            identities=[
                pb.IdentityEndpoints(
                    identity=u.identity,
                    labels=[label_pb(lb) for lb in labels],
                    node=u.node,
                    ref_count=u.refs,
                    owners=u.owners,
                )
                for u, labels in uses
            ],
            revision=revision,
        )

    # --- rules ---

    async def PutRules(self, request: pb.PutRulesRequest, context: Ctx) -> pb.PutRulesResponse:
        with self.service.rules.changes.counting():
            return await self._put_rules(request)

    async def _put_rules(self, request: pb.PutRulesRequest) -> pb.PutRulesResponse:
        which = request.WhichOneof("source")
        warnings: list[str] = []
        if which == "rules":
            rules = [
                rule_from_pb(r, f"rules.rules[{i}]", warnings)
                for i, r in enumerate(request.rules.rules)
            ]
        elif which == "document":
            rules = parse_document(request.document, warnings=warnings)
        else:
            raise InvalidArgument("give rules or a document", field="source")
        names, revision = await self.service.put_rules(check_rules(rules))
        return pb.PutRulesResponse(names=names, revision=revision, warnings=warnings)

    async def GetRule(self, request: pb.GetRuleRequest, context: Ctx) -> pb.Rule:
        check_key(request.name)
        return rule_pb(self.service.get_rule(request.name))

    async def DeleteRule(
        self, request: pb.DeleteRuleRequest, context: Ctx
    ) -> pb.DeleteRuleResponse:
        check_key(request.name)
        with self.service.rules.changes.counting():
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

    # --- CIDR groups ---

    async def PutCIDRGroup(self, request: pb.CIDRGroup, context: Ctx) -> pb.PutCIDRGroupResponse:
        revision = await self.service.put_cidr_group(cidr_group_from_pb(request))
        return pb.PutCIDRGroupResponse(revision=revision)

    async def DeleteCIDRGroup(
        self, request: pb.DeleteCIDRGroupRequest, context: Ctx
    ) -> pb.DeleteCIDRGroupResponse:
        check_key(request.name)
        deleted, revision = await self.service.delete_cidr_group(request.name)
        return pb.DeleteCIDRGroupResponse(deleted=deleted, revision=revision)

    async def ListCIDRGroups(
        self, request: pb.ListCIDRGroupsRequest, context: Ctx
    ) -> pb.ListCIDRGroupsResponse:
        groups, revision = self.service.list_cidr_groups()
        return pb.ListCIDRGroupsResponse(
            groups=[cidr_group_pb(g) for g in groups], revision=revision
        )

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
        if request.protocol not in PROTOCOLS:
            raise InvalidArgument("unknown protocol", field="protocol")
        protocol = PROTOCOLS[request.protocol]
        dport = request.dport
        if protocol in ICMP_PROTOCOLS:
            if dport > 255:
                raise InvalidArgument(f"ICMP type {dport} out of range (0-255)", field="dport")
            dport = icmp_port(dport)  # a packet always has a type: 0 is echo reply
        trace = self.service.trace(src, dst, dport, protocol)
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
        messages = PolicyMessages(
            self.policy_events,
            self.contents,
            self.service.mirror.commit_time,
            self.service.watch_counters,
        )
        async for event in self.service.watch_policy(
            request.node, request.since_revision, messages
        ):
            yield event

    async def WatchHostPolicy(
        self, request: pb.WatchHostPolicyRequest, context: Ctx
    ) -> AsyncIterator[pb.HostPolicyEvent]:
        check_node(request.node)
        labels = tuple(sorted(request.node_labels.items()))
        try:
            host_info(dict(labels))
        except LabelError as exc:
            raise InvalidArgument(str(exc), field="node_labels") from None
        async for host in self.service.watch_host_policy(request.node, labels):
            yield host_policy_event_pb(host, self.contents)

    # --- runtime configuration ---

    async def GetConfig(self, request: pb.GetConfigRequest, context: Ctx) -> pb.RuntimeConfig:
        if request.node:
            check_node(request.node)
        return config_pb(await self.service.get_config(request.node))

    async def PatchConfig(self, request: pb.PatchConfigRequest, context: Ctx) -> pb.RuntimeConfig:
        if request.node:
            check_node(request.node)
        if request.expected_revision < 0:
            raise InvalidArgument("must not be negative", field="expected_revision")
        if not request.set and not request.reset:
            raise InvalidArgument("nothing to set or reset", field="set")
        view = await self.service.patch_config(
            request.node, dict(request.set), list(request.reset), request.expected_revision
        )
        return config_pb(view)

    async def WatchConfig(
        self, request: pb.WatchConfigRequest, context: Ctx
    ) -> AsyncIterator[pb.ConfigEvent]:
        check_node(request.node)
        if request.since_revision < 0:
            raise InvalidArgument("must not be negative", field="since_revision")
        async for event in self.service.watch_config(request.node, request.since_revision):
            yield config_event_pb(event)

    async def GetDebuginfo(self, request: pb.GetDebuginfoRequest, context: Ctx) -> pb.Debuginfo:
        state = {
            "identities": await self.ListIdentities(pb.ListIdentitiesRequest(), context),
            "rules": await self.ListRules(pb.ListRulesRequest(), context),
            "cidr_groups": await self.ListCIDRGroups(pb.ListCIDRGroupsRequest(), context),
        }
        return answer(self.debuginfo, pb.Debuginfo(), state)
