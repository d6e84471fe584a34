"""gRPC handlers of flagella.endpoint.v1: proto <-> domain and validation."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.common.debuginfo import Debuginfo, answer
from flagella.common.errors import InvalidArgument, NotFound
from flagella.common.portnames import NamedPort, check_named_ports, protocol_name
from flagella.common.runtimeconfig import BY_NAME, ENDPOINT_OPTIONS, validate_endpoint_options
from flagella.endpoint.labelsources import LabelPatch, LabelSources, custom_key, pod_label_key
from flagella.endpoint.model import Endpoint, State
from flagella.endpoint.service import CreateRequest, EndpointService
from flagella.endpoint.status import CniStatus

STATES = {
    State.WAITING_FOR_IDENTITY: endpoint_pb2.ENDPOINT_STATE_WAITING_FOR_IDENTITY,
    State.REGENERATING: endpoint_pb2.ENDPOINT_STATE_REGENERATING,
    State.READY: endpoint_pb2.ENDPOINT_STATE_READY,
    State.DISCONNECTING: endpoint_pb2.ENDPOINT_STATE_DISCONNECTING,
    State.DISCONNECTED: endpoint_pb2.ENDPOINT_STATE_DISCONNECTED,
    State.NOT_READY: endpoint_pb2.ENDPOINT_STATE_NOT_READY,
    State.RESTORING: endpoint_pb2.ENDPOINT_STATE_RESTORING,
}
STATE_OF = {v: k for k, v in STATES.items()}

IFNAME = re.compile(r"^[^/\s:]{1,15}$")
# Kubernetes label keys: optional DNS prefix, then a name of up to 63 chars.
LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _ts(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def validate_labels(labels: dict[str, str], field: str) -> dict[str, str]:
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if not name or not LABEL_NAME.match(name) or (prefix and not LABEL_PREFIX.match(prefix)):
            raise InvalidArgument(f"{key!r} is not a valid label key", field=f"{field}[{key!r}]")
        if not LABEL_NAME.match(value):
            raise InvalidArgument(
                f"{value!r} is not a valid label value", field=f"{field}[{key!r}]"
            )
    return dict(labels)


def attachment_of(msg: endpoint_pb2.Attachment, field: str = "attachment") -> tuple[str, str]:
    """(container id, ifname) of an attachment; field: where it is in the
    request ("": its fields are the request's own)."""
    at = f"{field}." if field else ""
    if not msg.container_id:
        raise InvalidArgument("container_id is required", field=f"{at}container_id")
    if not IFNAME.match(msg.ifname):
        raise InvalidArgument(f"{msg.ifname!r} is not an interface name", field=f"{at}ifname")
    return msg.container_id, msg.ifname


def endpoint_to_proto(ep: Endpoint) -> endpoint_pb2.Endpoint:
    return endpoint_pb2.Endpoint(
        id=ep.id,
        container_id=ep.container_id,
        ifname=ep.ifname,
        netns_path=ep.netns_path,
        pod_name=ep.pod_name,
        pod_namespace=ep.pod_namespace,
        node=ep.node,
        labels=ep.labels,
        identity=ep.identity,
        addresses=ep.addresses,
        host_ifname=ep.host_ifname,
        mac=ep.mac,
        state=STATES[ep.state],
        policy_revision=ep.policy_revision,
        created_at=_ts(ep.created_at),
        updated_at=_ts(ep.updated_at),
        named_ports=[
            endpoint_pb2.NamedPort(name=p.name, port=p.port, protocol=protocol_name(p.protocol))
            for p in ep.named_ports
        ],
        options=ep.options,
        custom_labels=ep.custom_labels,
        disabled_labels=ep.disabled_labels,
    )


def endpoint_config_pb(ep: Endpoint) -> endpoint_pb2.EndpointConfig:
    return endpoint_pb2.EndpointConfig(
        id=ep.id,
        options=ep.options,
        allowed={name: ",".join(BY_NAME[name].allowed) for name in ENDPOINT_OPTIONS},
    )


def _labels_pb(labels: list[tuple[str, str, str]]) -> list[endpoint_pb2.EndpointLabel]:
    return [endpoint_pb2.EndpointLabel(source=s, key=k, value=v) for s, k, v in labels]


def label_sources_pb(endpoint_id: int, s: LabelSources) -> endpoint_pb2.EndpointLabels:
    return endpoint_pb2.EndpointLabels(
        id=endpoint_id,
        identity=s.identity,
        orchestration_identity=_labels_pb(s.orchestration_identity),
        orchestration_info=_labels_pb(s.orchestration_info),
        custom=_labels_pb(s.custom),
        disabled=_labels_pb(s.disabled),
    )


def label_patch(request: endpoint_pb2.PatchEndpointLabelsRequest) -> LabelPatch | None:
    """The custom and disabled changes of a PatchEndpointLabels, checked
    (None: it has none)."""
    if not (request.add_custom or request.delete_custom or request.disable or request.enable):
        return None
    add = {}
    for key, value in request.add_custom.items():
        field = f"add_custom[{key!r}]"
        validate_labels({"x": value}, field)
        add[custom_key(key, field)] = value
    return LabelPatch(
        add_custom=add,
        delete_custom=tuple(
            custom_key(k, f"delete_custom[{i}]") for i, k in enumerate(request.delete_custom)
        ),
        disable=tuple(pod_label_key(k, f"disable[{i}]") for i, k in enumerate(request.disable)),
        enable=tuple(pod_label_key(k, f"enable[{i}]") for i, k in enumerate(request.enable)),
    )


def result_to_proto(result: dict[str, Any]) -> endpoint_pb2.CniResult:
    dns = result.get("dns", {})
    return endpoint_pb2.CniResult(
        cni_version="1.1.0",
        interfaces=[
            endpoint_pb2.CniInterface(
                name=i["name"],
                mac=i.get("mac", ""),
                sandbox=i.get("sandbox", ""),
                mtu=i.get("mtu", 0),
            )
            for i in result.get("interfaces", [])
        ],
        ips=[
            endpoint_pb2.CniIPConfig(
                address=ip["address"], gateway=ip.get("gateway", ""), interface=ip["interface"]
            )
            for ip in result.get("ips", [])
        ],
        routes=[
            endpoint_pb2.CniRoute(dst=r["dst"], gw=r.get("gw", ""))
            for r in result.get("routes", [])
        ],
        dns=endpoint_pb2.CniDNS(
            nameservers=dns.get("nameservers", []), search=dns.get("search", [])
        ),
    )


def create_request_of(request: endpoint_pb2.CreateEndpointRequest) -> CreateRequest:
    """A CreateEndpointRequest, validated (what a CNI ADD creates too)."""
    cid, ifname = (
        attachment_of(
            endpoint_pb2.Attachment(container_id=request.container_id, ifname=request.ifname),
            "",
        )
        if request.container_id
        else ("", "")
    )
    if not cid:
        raise InvalidArgument("container_id is required", field="container_id")
    if not request.netns_path.startswith("/"):
        raise InvalidArgument(
            f"{request.netns_path!r} is not an absolute netns path", field="netns_path"
        )
    if not request.node:
        raise InvalidArgument("node is required", field="node")
    mtu = request.mtu or 1500
    if not 576 <= mtu <= 65535:
        raise InvalidArgument(f"mtu {mtu} is not in 576..65535", field="mtu")
    if request.pod_name and not request.pod_namespace:
        raise InvalidArgument("pod_namespace is required with pod_name", field="pod_namespace")
    if request.resolve_labels_from_kubernetes and not request.labels and not request.pod_name:
        raise InvalidArgument(
            "pod_name is required to read labels from Kubernetes", field="pod_name"
        )
    return CreateRequest(
        container_id=cid,
        netns_path=request.netns_path,
        ifname=ifname,
        node=request.node,
        pod_name=request.pod_name,
        pod_namespace=request.pod_namespace,
        labels=validate_labels(dict(request.labels), "labels"),
        resolve_labels_from_kubernetes=request.resolve_labels_from_kubernetes,
        mtu=mtu,
        named_ports=named_ports_of(request.named_ports),
    )


def named_ports_of(ports: Iterable[endpoint_pb2.NamedPort]) -> tuple[NamedPort, ...]:
    items = [(p.name, p.port, p.protocol) for p in ports]
    out, field, reason = check_named_ports(items)
    if field:
        raise InvalidArgument(reason, field=f"named_ports{field}")
    return tuple(out)


class CniRun(Protocol):
    """flagella.endpoint.cnirun.CniRunner: one plugin invocation run."""

    async def __call__(
        self, environ: Mapping[str, str], config: bytes, *, netns_exists: bool, node: str
    ) -> tuple[str, int]: ...


def caller_node(request: endpoint_pb2.CniRequest, context: Any) -> str:
    """The node a relayed CNI invocation comes from: the request's node,
    which the node's datapath sets and authorization holds to the caller's
    certificate (authz: `Cni` is own_node("node")), so a node acts only for
    itself."""
    if not request.node:
        raise InvalidArgument("node is required", field="node")
    return request.node


class EndpointServicer(endpoint_pb2_grpc.EndpointServiceServicer):
    def __init__(
        self,
        service: EndpointService,
        status: CniStatus,
        cni: CniRun,
        debuginfo: Debuginfo | None = None,
    ) -> None:
        self.service = service
        self.debuginfo = debuginfo
        self.status = status
        self.cni = cni

    async def CreateEndpoint(
        self, request: endpoint_pb2.CreateEndpointRequest, context: Any
    ) -> endpoint_pb2.CreateEndpointResponse:
        ep = await self.service.create(create_request_of(request))
        return endpoint_pb2.CreateEndpointResponse(
            endpoint=endpoint_to_proto(ep), result=result_to_proto(ep.result)
        )

    async def _resolve(self, request: Any) -> Endpoint:
        which = request.WhichOneof("by")
        if which == "id":
            return await self.service.get_by_id(request.id)
        if which == "attachment":
            return await self.service.get(*attachment_of(request.attachment))
        raise InvalidArgument("give id or attachment", field="by")

    async def node_of(self, request: Any) -> str | None:
        """The node of the endpoint a request names, for authorization
        (authz.node_of("endpoint")); None when there is no such endpoint,
        or the request names none (the handler then says what is wrong)."""
        try:
            if request.DESCRIPTOR.name == "CheckEndpointRequest":
                ep = await self.service.get(*attachment_of(request.attachment))
            else:
                ep = await self._resolve(request)
        except (NotFound, InvalidArgument):
            return None
        return ep.node

    async def GetEndpoint(
        self, request: endpoint_pb2.GetEndpointRequest, context: Any
    ) -> endpoint_pb2.Endpoint:
        return endpoint_to_proto(await self._resolve(request))

    async def ListEndpoints(
        self, request: endpoint_pb2.ListEndpointsRequest, context: Any
    ) -> endpoint_pb2.ListEndpointsResponse:
        state = STATE_OF.get(request.state) if request.state else None
        eps = await self.service.list_endpoints(request.node, request.pod_namespace, state)
        return endpoint_pb2.ListEndpointsResponse(
            endpoints=[endpoint_to_proto(ep) for ep in sorted(eps, key=lambda e: e.id)]
        )

    async def DeleteEndpoint(
        self, request: endpoint_pb2.DeleteEndpointRequest, context: Any
    ) -> endpoint_pb2.DeleteEndpointResponse:
        which = request.WhichOneof("by")
        if which == "id":
            deleted = await self.service.delete_by_id(request.id)
        elif which == "attachment":
            deleted = await self.service.delete(*attachment_of(request.attachment))
        else:
            raise InvalidArgument("give id or attachment", field="by")
        return endpoint_pb2.DeleteEndpointResponse(deleted=deleted)

    async def PatchEndpointLabels(
        self, request: endpoint_pb2.PatchEndpointLabelsRequest, context: Any
    ) -> endpoint_pb2.Endpoint:
        extra = label_patch(request)
        labels = (
            validate_labels(dict(request.labels), "labels")
            if request.labels or extra is None
            else None
        )
        return endpoint_to_proto(await self.service.patch_labels(request.id, labels, extra=extra))

    async def GetEndpointLabels(
        self, request: endpoint_pb2.GetEndpointLabelsRequest, context: Any
    ) -> endpoint_pb2.EndpointLabels:
        return label_sources_pb(request.id, await self.service.label_sources(request.id))

    async def GetEndpointConfig(
        self, request: endpoint_pb2.GetEndpointConfigRequest, context: Any
    ) -> endpoint_pb2.EndpointConfig:
        return endpoint_config_pb(await self.service.get_by_id(request.id))

    async def PatchEndpointConfig(
        self, request: endpoint_pb2.PatchEndpointConfigRequest, context: Any
    ) -> endpoint_pb2.EndpointConfig:
        validate_endpoint_options(request.set, "set")
        for i, name in enumerate(request.reset):
            if name not in ENDPOINT_OPTIONS or name in request.set:
                raise InvalidArgument(
                    f"{name!r}: not an endpoint option, or also set", field=f"reset[{i}]"
                )
        if not request.set and not request.reset:
            raise InvalidArgument("nothing to set or reset", field="set")
        ep = await self.service.patch_config(request.id, dict(request.set), list(request.reset))
        return endpoint_config_pb(ep)

    async def GetEndpointLog(
        self, request: endpoint_pb2.GetEndpointLogRequest, context: Any
    ) -> endpoint_pb2.GetEndpointLogResponse:
        ep = await self.service.get_by_id(request.id)
        return endpoint_pb2.GetEndpointLogResponse(
            entries=[
                endpoint_pb2.EndpointLogEntry(
                    time=_ts(e.time),
                    from_state=STATES[State(e.from_state)],
                    to_state=STATES[State(e.to_state)],
                    reason=e.reason,
                )
                for e in ep.log
            ]
        )

    async def GetEndpointHealth(
        self, request: endpoint_pb2.GetEndpointHealthRequest, context: Any
    ) -> endpoint_pb2.EndpointHealth:
        ep = await self.service.get_by_id(request.id)
        health = await self.service.health(ep)
        overall = (
            endpoint_pb2.EndpointHealth.STATUS_OK
            if all(v == "ok" for v in health.values())
            else endpoint_pb2.EndpointHealth.STATUS_FAILURE
        )
        return endpoint_pb2.EndpointHealth(overall=overall, components=health)

    async def CheckEndpoint(
        self, request: endpoint_pb2.CheckEndpointRequest, context: Any
    ) -> endpoint_pb2.CheckEndpointResponse:
        cid, ifname = attachment_of(request.attachment)
        await self.service.check(cid, ifname, request.netns_path)
        return endpoint_pb2.CheckEndpointResponse()

    async def GarbageCollect(
        self, request: endpoint_pb2.GarbageCollectRequest, context: Any
    ) -> endpoint_pb2.GarbageCollectResponse:
        if not request.node:
            raise InvalidArgument("node is required", field="node")
        valid = [
            attachment_of(a, f"valid_attachments[{i}]")
            for i, a in enumerate(request.valid_attachments)
        ]
        removed = await self.service.garbage_collect(request.node, valid)
        return endpoint_pb2.GarbageCollectResponse(removed=[endpoint_to_proto(e) for e in removed])

    async def GetStatus(
        self, request: endpoint_pb2.GetStatusRequest, context: Any
    ) -> endpoint_pb2.EndpointServiceStatus:
        ready, deps = await self.status()
        return endpoint_pb2.EndpointServiceStatus(ready=ready, dependencies=deps)

    async def Cni(self, request: endpoint_pb2.CniRequest, context: Any) -> endpoint_pb2.CniResponse:
        node = caller_node(request, context)
        environ = {
            "CNI_COMMAND": request.command,
            "CNI_CONTAINERID": request.container_id,
            "CNI_NETNS": request.netns,
            "CNI_IFNAME": request.ifname,
            "CNI_ARGS": request.args,
            "CNI_PATH": request.path,
        }
        stdout, exit_code = await self.cni(
            environ, request.config, netns_exists=request.netns_exists, node=node
        )
        return endpoint_pb2.CniResponse(stdout=stdout.encode(), exit_code=exit_code)

    async def GetDebuginfo(
        self, request: endpoint_pb2.GetDebuginfoRequest, context: Any
    ) -> endpoint_pb2.Debuginfo:
        state = {
            "status": await self.GetStatus(endpoint_pb2.GetStatusRequest(), context),
            "endpoints": await self.ListEndpoints(endpoint_pb2.ListEndpointsRequest(), context),
        }
        return answer(self.debuginfo, endpoint_pb2.Debuginfo(), state)
