"""Who may call which RPC: one table, enforced by one server interceptor.

Every method of every flagella service has an entry (a test walks the proto
descriptors), naming the identities that may call it; an entry can scope a
node to its own resources: the node a request names (`own_node("name")`), or
the node an existing resource is on (`node_of("endpoint")`, looked up by the
service that owns it). A method with no entry is refused: nothing fails
open. `python -m flagella.common.authz` prints the table as Markdown.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from flagella.common.errors import bounded
from flagella.common.handlers import WrappingInterceptor, relay, rewrap
from flagella.common.pki import Identity
from flagella.common.tls import Unauthenticated, parse_peer, peer_identity

log = logging.getLogger(__name__)

#: request -> the node the resource it names is on; None when there is no
#: such resource (nothing to protect: the call finds nothing).
Resolver = Callable[[Any], Awaitable[str | None]]


class Denied(Exception):
    """The identity may not make this call."""


# --- grants ---


@dataclass(frozen=True)
class Grant:
    """Whom a table entry lets call: a kind, and its argument (a service's
    name, the request field naming a node, the resource a node must own)."""

    kind: str
    arg: str = ""

    def describe(self) -> str:
        return _DESCRIPTIONS[self.kind].format(self.arg)


_DESCRIPTIONS = {
    "anyone": "any authenticated identity",
    "service": "service `{}`",
    "node": "any node",
    "own-node": "a node, itself only (request `{}`)",
    "node-of": "a node, its own {}s only",
    "operator": "operators",
}


def service(name: str) -> Grant:
    return Grant("service", name)


def own_node(field: str) -> Grant:
    """A node, for itself: the request's `field` must be its name."""
    return Grant("own-node", field)


def node_of(resource: str) -> Grant:
    """A node, for the resources on it: the service that owns the resource
    resolves the one a request names to its node."""
    return Grant("node-of", resource)


ENDPOINT = service("endpoint")
POLICY = service("policy")
RELAY = service("relay")
OPERATOR = Grant("operator")
NODES = Grant("node")
ANYONE = (Grant("anyone"),)
READERS = (NODES, OPERATOR)


def _methods(prefix: str, grants: Mapping[str, tuple[Grant, ...]]) -> dict[str, tuple[Grant, ...]]:
    return {f"/{prefix}/{name}": g for name, g in grants.items()}


#: method full name -> who may call it. The document of record: keep the
#: reason beside any entry that is not obvious.
TABLE: dict[str, tuple[Grant, ...]] = {
    **_methods("grpc.health.v1.Health", {"Check": ANYONE, "List": ANYONE, "Watch": ANYONE}),
    **_methods("grpc.reflection.v1alpha.ServerReflection", {"ServerReflectionInfo": ANYONE}),
    **_methods(
        "flagella.ipam.v1.IpamService",
        {
            # A node's datapath registers and keeps its own node alive.
            "RegisterNode": (own_node("name"),),
            "RenewNode": (own_node("name"),),
            # Operators decommission nodes.
            "DeregisterNode": (own_node("name"), OPERATOR),
            # The endpoint service and the relay follow the registry to reach datapaths.
            "GetNode": (ENDPOINT, NODES, OPERATOR, RELAY),
            "ListNodes": (ENDPOINT, NODES, OPERATOR, RELAY),
            "WatchNodes": (ENDPOINT, NODES, OPERATOR, RELAY),
            # Addresses are handed out by the endpoint service only.
            "Allocate": (ENDPOINT,),
            "AllocateIP": (ENDPOINT,),
            "CommitAllocation": (ENDPOINT,),
            "Reconcile": (ENDPOINT,),
            # Operators may free a leaked address by hand.
            "Release": (ENDPOINT, OPERATOR),
            "ListAllocations": (ENDPOINT, OPERATOR),
            "GetStatus": (OPERATOR,),
            # Nodes number each other (e.g. tunnel peers) by node id.
            "GetNodeIds": READERS,
            # Debuginfo: configuration, state and recent errors, for operators.
            "GetDebuginfo": (OPERATOR,),
        },
    ),
    **_methods(
        "flagella.policy.v1.PolicyService",
        {
            "AllocateIdentity": (ENDPOINT,),
            "ReleaseIdentity": (ENDPOINT,),
            # Nodes read their endpoints' identities' labels (what local
            # redirect policies select backends by).
            "GetIdentity": (ENDPOINT, OPERATOR, NODES),
            # The relay names the ends of its web page's flows (labels).
            "ListIdentities": (OPERATOR, RELAY),
            # The ipcache maps pod IPs to identities: written for endpoints only.
            "UpsertIPCache": (ENDPOINT,),
            "DeleteIPCache": (ENDPOINT,),
            "ListIPCache": READERS,
            "WatchIPCache": READERS,
            # Rules come from operators (and the Kubernetes watchers inside
            # the policy service, which write to the store, not over gRPC).
            "PutRules": (OPERATOR,),
            "DeleteRule": (OPERATOR,),
            "GetRule": (OPERATOR,),
            "ListRules": (OPERATOR,),
            "PutCIDRGroup": (OPERATOR,),
            "DeleteCIDRGroup": (OPERATOR,),
            "ListCIDRGroups": (OPERATOR,),
            "ResolvePolicy": (OPERATOR,),
            "TracePolicy": (OPERATOR,),
            # A node reads the policy of its own endpoints.
            "WatchPolicy": (own_node("node"), OPERATOR),
            "WatchHostPolicy": (own_node("node"), OPERATOR),
            # A node's DNS proxy writes what its endpoints' names resolved
            # to, for itself only; operators list and flush the cache.
            "UpsertFQDNCache": (own_node("node"),),
            "DeleteFQDNCache": (own_node("node"), OPERATOR),
            "ListFQDNCache": READERS,
            "ListFQDNSelectors": READERS,
            # Introspection: a node asks about its own identities.
            "GetPolicySelectors": READERS,
            "GetIdentityEndpoints": (own_node("node"), OPERATOR),
            # Runtime configuration: operators change it; a node follows
            # its own values.
            "GetConfig": READERS,
            "PatchConfig": (OPERATOR,),
            "WatchConfig": (own_node("node"), OPERATOR),
            "GetDebuginfo": (OPERATOR,),
        },
    ),
    **_methods(
        "flagella.lb.v1.LoadBalancerService",
        {
            # Services come from operators (and lb's own Kubernetes watcher).
            "UpsertService": (OPERATOR,),
            "UpsertServices": (OPERATOR,),
            "DeleteService": (OPERATOR,),
            "GetService": READERS,
            # The policy service follows the services for toServices rules;
            # the relay names the services its web page's flows are sent to.
            "ListServices": (*READERS, POLICY, RELAY),
            "WatchServices": (*READERS, POLICY),
            "GetMaglevTable": READERS,
            "GetDebuginfo": (OPERATOR,),
            # Local redirect policies come from operators; every node
            # follows them and picks its own local backends.
            "CreateLrp": (OPERATOR,),
            "DeleteLrp": (OPERATOR,),
            "GetLrp": READERS,
            "WatchLrps": READERS,
            # LB-IPAM pools: operators write them.
            "UpsertLbIpPool": (OPERATOR,),
            "DeleteLbIpPool": (OPERATOR,),
            "ListLbIpPools": READERS,
            # BGP peering policies: operators write them; every node follows
            # them (the stream carries the neighbours' passwords: nodes only).
            "UpsertBgpPeeringPolicy": (OPERATOR,),
            "DeleteBgpPeeringPolicy": (OPERATOR,),
            "ListBgpPeeringPolicies": READERS,
            "WatchBgpPeeringPolicies": (NODES,),
        },
    ),
    **_methods(
        "flagella.endpoint.v1.EndpointService",
        {
            # flagella-cni's invocations, relayed by the node's datapath for
            # that node only (the endpoint service acts on the request's node).
            "Cni": (own_node("node"),),
            # The CNI calls, made for a node.
            "CreateEndpoint": (own_node("node"),),
            "DeleteEndpoint": (node_of("endpoint"),),
            "CheckEndpoint": (node_of("endpoint"),),
            "GarbageCollect": (own_node("node"),),
            "GetStatus": (NODES, OPERATOR),
            "GetEndpoint": (node_of("endpoint"), OPERATOR),
            # The relay names the ends of its web page's flows (pods).
            "ListEndpoints": (own_node("node"), OPERATOR, RELAY),
            "PatchEndpointLabels": (OPERATOR,),
            "GetEndpointLog": (OPERATOR,),
            "GetEndpointHealth": (OPERATOR,),
            "GetEndpointConfig": (OPERATOR,),
            "PatchEndpointConfig": (OPERATOR,),
            "GetEndpointLabels": (OPERATOR,),
            "GetDebuginfo": (OPERATOR,),
        },
    ),
    **_methods(
        "flagella.datapath.v1.DatapathService",
        {
            # Only the endpoint service sets endpoints up and tears them down.
            "SetupEndpoint": (ENDPOINT,),
            "TeardownEndpoint": (ENDPOINT,),
            "UpdateEndpoint": (ENDPOINT,),
            "WaitForPolicy": (ENDPOINT,),
            "GetEndpoint": (ENDPOINT, OPERATOR),
            "ListEndpoints": (ENDPOINT, OPERATOR),
            "ListMaps": (OPERATOR,),
            "DumpMap": (OPERATOR,),
            "GetStatus": (OPERATOR,),
            # The relay merges every node's flows for operators.
            "ObserveFlows": (OPERATOR, RELAY),
            "GetPrefilter": (OPERATOR,),
            "PatchPrefilter": (OPERATOR,),
            "DeletePrefilter": (OPERATOR,),
            # A map's writes show its keys and values, as DumpMap does.
            "GetMapEvents": (OPERATOR,),
            "GetDebuginfo": (OPERATOR,),
            "GetCgroupDumpMetadata": (OPERATOR,),
            # The node's BGP speaker, its sessions, routes and export policies.
            "GetBgpPeers": (OPERATOR,),
            "GetBgpRoutes": (OPERATOR,),
            "GetBgpRoutePolicies": (OPERATOR,),
        },
    ),
    **_methods(
        "flagella.relay.v1.RelayService",
        {"ObserveFlows": (OPERATOR,), "GetNodes": (OPERATOR,), "GetDebuginfo": (OPERATOR,)},
    ),
}


def _field(request: Any, path: str) -> str:
    value = request
    for part in path.split("."):
        value = getattr(value, part, "")
    return str(value)


class Authorizer:
    """Checks a call against the table. Resolvers (for `node_of` grants) are
    registered by the service that owns the resource."""

    def __init__(
        self,
        table: Mapping[str, tuple[Grant, ...]] = TABLE,
        resolvers: Mapping[str, Resolver] | None = None,
    ) -> None:
        self.table = table
        self.resolvers: dict[str, Resolver] = dict(resolvers or {})

    async def check(self, method: str, identity: Identity, request: Any) -> None:
        """Return if identity may call method with request; raise Denied."""
        grants = self.table.get(method)
        if grants is None:
            raise Denied("the method has no authorization entry")
        reasons = []
        for grant in grants:
            reason = await self._refuses(grant, identity, request)
            if reason is None:
                return
            if reason:
                reasons.append(reason)
        raise Denied("; ".join(reasons) or "not allowed for this identity")

    async def _refuses(self, grant: Grant, identity: Identity, request: Any) -> str | None:
        """None if grant allows; else why not ('' when it does not concern
        this kind of identity)."""
        if grant.kind == "anyone":
            return None
        if grant.kind in ("service", "operator", "node"):
            allowed = identity.kind == grant.kind and grant.arg in ("", identity.name)
            return None if allowed else ""
        if identity.kind != "node" or request is None:
            return ""
        if grant.kind == "own-node":
            named = _field(request, grant.arg)
            if named == identity.name:
                return None
            return f"{grant.arg} {named!r} is not the caller's node"
        if grant.kind != "node-of":
            return f"unknown grant {grant.kind!r}"
        resolver = self.resolvers.get(grant.arg)
        if resolver is None:
            log.error("no authorization resolver", extra={"resource": grant.arg})
            return f"cannot tell which node the {grant.arg} is on"
        owner = await resolver(request)
        if owner is None or owner == identity.name:
            return None
        return f"the {grant.arg} is on node {owner!r}"


# --- the interceptor ---


class AuthInterceptor(WrappingInterceptor):
    """Authenticates every call by its client certificate, then authorizes
    it against the table (after the request is deserialized: scoping reads
    it), before the handler runs. UNAUTHENTICATED without a usable
    certificate; PERMISSION_DENIED naming the method and the identity."""

    def __init__(
        self, authorizer: Authorizer, clock: Callable[[], dt.datetime] | None = None
    ) -> None:
        self.authorizer = authorizer
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))
        # Callers keep their connections: parse each certificate once.
        self._parse = functools.lru_cache(maxsize=256)(parse_peer)

    async def _admit(self, method: str, request: Any, context: Any) -> None:
        if not isinstance(request, Message):
            request = None  # a stream of requests: nothing to scope by
        try:
            identity = peer_identity(context.auth_context(), self.clock(), self._parse)
        except Unauthenticated as exc:
            log.warning("unauthenticated call", extra={"method": method, "reason": str(exc)})
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
        try:
            await self.authorizer.check(method, identity, request)
        except Denied as exc:
            message = bounded(f"{identity.uri} may not call {method}: {exc}")
            log.warning(
                "permission denied",
                extra={"method": method, "identity": identity.uri, "reason": str(exc)},
            )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a resolver that cannot look: deny
            log.warning("authorization lookup failed", extra={"method": method}, exc_info=exc)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"authorization lookup failed for {method}"
            )

    def wrap(self, handler: Any, method: str) -> Any:
        admit = self._admit

        def unary(inner: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: Any) -> Any:
                await admit(method, request, context)
                return await inner(request, context)

            return call

        def stream(inner: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: Any) -> AsyncIterator[Any]:
                await admit(method, request, context)
                async for item in relay(inner(request, context)):
                    yield item

            return call

        return rewrap(handler, unary, stream, streaming_requests=True)


# --- the document ---


def markdown(table: Mapping[str, tuple[Grant, ...]] = TABLE) -> str:
    """The table as Markdown, one row per method (docs/SECURITY.md)."""
    lines = ["| method | who may call it |", "|---|---|"]
    for method, grants in table.items():
        who = "; ".join(g.describe() for g in grants)
        lines.append(f"| `{method.lstrip('/')}` | {who} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
