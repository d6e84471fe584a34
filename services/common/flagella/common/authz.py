"""Who may call which RPC: one table, enforced by one server interceptor.

Every method of every flagella service has an entry (a test walks the proto
descriptors), naming the identities that may call it; an entry can scope a
node to its own resources: the node a request names (`OwnNode("name")`), or
the node an existing resource is on (`NodeOf("endpoint")`, looked up by the
service that owns it). A method with no entry is refused: nothing fails
open. `python -m flagella.common.authz` prints the table as Markdown.
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from flagella.common.pki import Identity
from flagella.common.tls import Unauthenticated, peer_identity

log = logging.getLogger(__name__)

#: request -> the node the resource it names is on; None when there is no
#: such resource (nothing to protect: the call finds nothing).
Resolver = Callable[[Any], Awaitable[str | None]]


class Denied(Exception):
    """The identity may not make this call."""


# --- grants ---


@dataclass(frozen=True)
class Anyone:
    """Any authenticated identity."""

    def describe(self) -> str:
        return "any authenticated identity"


@dataclass(frozen=True)
class Service:
    name: str

    def describe(self) -> str:
        return f"service `{self.name}`"


@dataclass(frozen=True)
class AnyNode:
    def describe(self) -> str:
        return "any node"


@dataclass(frozen=True)
class OwnNode:
    """A node, for itself: the request's `field` must be its name."""

    field: str

    def describe(self) -> str:
        return f"a node, itself only (request `{self.field}`)"


@dataclass(frozen=True)
class NodeOf:
    """A node, for the resources on it: the service resolves the resource
    the request names to its node."""

    resource: str

    def describe(self) -> str:
        return f"a node, its own {self.resource}s only"


@dataclass(frozen=True)
class Operator:
    def describe(self) -> str:
        return "operators"


Grant = Anyone | Service | AnyNode | OwnNode | NodeOf | Operator

ENDPOINT = Service("endpoint")
OPERATOR = Operator()
NODES = AnyNode()
ANYONE = (Anyone(),)
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
            "RegisterNode": (OwnNode("name"),),
            "RenewNode": (OwnNode("name"),),
            # Operators decommission nodes.
            "DeregisterNode": (OwnNode("name"), OPERATOR),
            # The endpoint service follows the registry to reach datapaths.
            "GetNode": (ENDPOINT, NODES, OPERATOR),
            "ListNodes": (ENDPOINT, NODES, OPERATOR),
            "WatchNodes": (ENDPOINT, NODES, OPERATOR),
            # Addresses are handed out by the endpoint service only.
            "Allocate": (ENDPOINT,),
            "AllocateIP": (ENDPOINT,),
            "CommitAllocation": (ENDPOINT,),
            "Reconcile": (ENDPOINT,),
            # Operators may free a leaked address by hand.
            "Release": (ENDPOINT, OPERATOR),
            "ListAllocations": (ENDPOINT, OPERATOR),
            "GetStatus": (OPERATOR,),
        },
    ),
    **_methods(
        "flagella.policy.v1.PolicyService",
        {
            "AllocateIdentity": (ENDPOINT,),
            "ReleaseIdentity": (ENDPOINT,),
            "GetIdentity": (ENDPOINT, OPERATOR),
            "ListIdentities": (OPERATOR,),
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
            "ResolvePolicy": (OPERATOR,),
            "TracePolicy": (OPERATOR,),
            # A node reads the policy of its own endpoints.
            "WatchPolicy": (OwnNode("node"), OPERATOR),
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
            "ListServices": READERS,
            "WatchServices": READERS,
            "GetMaglevTable": READERS,
        },
    ),
    **_methods(
        "flagella.endpoint.v1.EndpointService",
        {
            # The CNI calls, made for a node (through its node-local relay).
            "CreateEndpoint": (OwnNode("node"),),
            "DeleteEndpoint": (NodeOf("endpoint"),),
            "CheckEndpoint": (NodeOf("endpoint"),),
            "GarbageCollect": (OwnNode("node"),),
            "GetStatus": (NODES, OPERATOR),
            "GetEndpoint": (NodeOf("endpoint"), OPERATOR),
            "ListEndpoints": (OwnNode("node"), OPERATOR),
            "PatchEndpointLabels": (OPERATOR,),
            "GetEndpointLog": (OPERATOR,),
            "GetEndpointHealth": (OPERATOR,),
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
            "ObserveFlows": (OPERATOR,),
        },
    ),
}


def _field(request: Any, path: str) -> str:
    value = request
    for part in path.split("."):
        value = getattr(value, part, "")
    return str(value)


class Authorizer:
    """Checks a call against the table. Resolvers (for `NodeOf` grants) are
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
        match grant:
            case Anyone():
                return None
            case Service(name):
                return None if identity == Identity("service", name) else ""
            case Operator():
                return None if identity.kind == "operator" else ""
            case AnyNode():
                return None if identity.kind == "node" else ""
        if identity.kind != "node" or request is None:
            return ""
        if isinstance(grant, OwnNode):
            named = _field(request, grant.field)
            if named == identity.name:
                return None
            return f"{grant.field} {named!r} is not the caller's node"
        resolver = self.resolvers.get(grant.resource)
        if resolver is None:
            log.error("no authorization resolver", extra={"resource": grant.resource})
            return f"cannot tell which node the {grant.resource} is on"
        owner = await resolver(request)
        if owner is None or owner == identity.name:
            return None
        return f"the {grant.resource} is on node {owner!r}"


# --- the interceptor ---


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call by its client certificate, then authorizes
    it against the table (after the request is deserialized: scoping reads
    it), before the handler runs. UNAUTHENTICATED without a usable
    certificate; PERMISSION_DENIED naming the method and the identity."""

    def __init__(
        self, authorizer: Authorizer, clock: Callable[[], dt.datetime] | None = None
    ) -> None:
        self.authorizer = authorizer
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))

    async def _admit(self, method: str, request: Any, context: Any) -> None:
        try:
            identity = peer_identity(context.auth_context(), self.clock())
        except Unauthenticated as exc:
            log.warning("unauthenticated call", extra={"method": method, "reason": str(exc)})
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
        try:
            await self.authorizer.check(method, identity, request)
        except Denied as exc:
            message = f"{identity.uri} may not call {method}: {exc}"
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

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        admit = self._admit
        common = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                await admit(method, request, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **common)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                await admit(method, request, context)
                result = inner_us(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:
                    await result

            return grpc.unary_stream_rpc_method_handler(unary_stream, **common)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                await admit(method, None, context)
                return await inner_su(requests, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **common)
        inner_ss = handler.stream_stream

        async def stream_stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            await admit(method, None, context)
            result = inner_ss(requests, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                await result

        return grpc.stream_stream_rpc_method_handler(stream_stream, **common)


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
