"""Local redirect policies over gRPC: proto <-> domain (flagella.lb.lrp)
and the WatchLrps messages. The handlers are LbServicer's."""

from __future__ import annotations

import json
from collections.abc import Sequence

from flagella.api.lb.v1 import lb_pb2
from flagella.common.errors import InvalidArgument
from flagella.common.sync import Change
from flagella.lb.lrp import Lrp, LrpPort, RawLrp
from flagella.lb.model import Protocol

pb = lb_pb2

_PROTOCOLS = {pb.PROTOCOL_TCP: Protocol.TCP, pb.PROTOCOL_UDP: Protocol.UDP}
_PROTOCOL_PB = {v: k for k, v in _PROTOCOLS.items()}


def _ports(ports: Sequence[lb_pb2.LrpPort], path: str) -> list[tuple[str, int, Protocol | None]]:
    out: list[tuple[str, int, Protocol | None]] = []
    for i, p in enumerate(ports):
        if p.protocol and p.protocol not in _PROTOCOLS:
            raise InvalidArgument(
                f"{p.protocol} is not a known protocol (6, 17)", field=f"{path}[{i}].protocol"
            )
        out.append((p.name, p.port, _PROTOCOLS.get(p.protocol)))
    return out


def raw_lrp(msg: lb_pb2.LocalRedirectPolicy) -> RawLrp:
    fe = msg.redirect_frontend
    matcher = fe.WhichOneof("matcher") or ""
    be = msg.redirect_backend
    sel = be.local_endpoint_selector
    fe_path = f"lrp.redirect_frontend.{matcher}.to_ports"
    return RawLrp(
        namespace=msg.namespace,
        name=msg.name,
        matcher=matcher,
        address=fe.address_matcher.ip,
        service=fe.service_matcher.service_name,
        service_namespace=fe.service_matcher.namespace,
        frontend_ports=_ports(
            fe.address_matcher.to_ports
            if matcher == "address_matcher"
            else fe.service_matcher.to_ports,
            fe_path,
        ),
        match_labels=dict(sel.match_labels),
        match_expressions=[(r.key, r.operator, list(r.values)) for r in sel.match_expressions],
        backend_ports=_ports(be.to_ports, "lrp.redirect_backend.to_ports"),
        skip_redirect_from_backend=msg.skip_redirect_from_backend,
        description=msg.description,
        has_backend=msg.HasField("redirect_backend"),
        has_selector=be.HasField("local_endpoint_selector"),
    )


MAX_DOCUMENT = 1 << 20


def parse_document(text: str) -> object:
    """CreateLrp's (and UpsertBgpPeeringPolicy's) document: JSON, at most a
    MiB."""
    if len(text) > MAX_DOCUMENT:
        raise InvalidArgument(f"at most {MAX_DOCUMENT} characters", field="document")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"not JSON: {exc}", field="document") from None
    except RecursionError:
        raise InvalidArgument("nested too deep", field="document") from None


def _ports_pb(ports: Sequence[LrpPort]) -> list[lb_pb2.LrpPort]:
    return [pb.LrpPort(name=p.name, port=p.port, protocol=_PROTOCOL_PB[p.protocol]) for p in ports]


def lrp_to_proto(lrp: Lrp) -> lb_pb2.LocalRedirectPolicy:
    out = pb.LocalRedirectPolicy(
        name=lrp.name,
        namespace=lrp.namespace,
        description=lrp.description,
        revision=lrp.revision,
        source=lrp.source,
    )
    fe = out.redirect_frontend
    if lrp.address:
        fe.address_matcher.ip = lrp.address
        fe.address_matcher.to_ports.extend(_ports_pb(lrp.frontend_ports))
    else:
        fe.service_matcher.service_name = lrp.service
        fe.service_matcher.namespace = lrp.namespace
        fe.service_matcher.to_ports.extend(_ports_pb(lrp.frontend_ports))
    sel = out.redirect_backend.local_endpoint_selector
    sel.match_labels.update(dict(lrp.match_labels))
    sel.match_expressions.extend(
        pb.LrpSelectorRequirement(key=r.key, operator=r.operator, values=r.values)
        for r in lrp.match_expressions
    )
    out.redirect_backend.to_ports.extend(_ports_pb(lrp.backend_ports))
    return out


class LrpEvents:
    """The WatchLrps messages of the policies table's changes."""

    def reset(self, revision: int) -> lb_pb2.LrpEvent:
        return pb.LrpEvent(kind=pb.LrpEvent.KIND_RESET, revision=revision)

    async def upsert(self, change: Change[str, Lrp]) -> lb_pb2.LrpEvent:
        assert change.record is not None
        return pb.LrpEvent(
            kind=pb.LrpEvent.KIND_UPSERT, lrp=lrp_to_proto(change.record), revision=change.revision
        )

    async def delete(self, change: Change[str, Lrp]) -> lb_pb2.LrpEvent:
        namespace, _, name = change.key.partition("/")
        return pb.LrpEvent(
            kind=pb.LrpEvent.KIND_DELETE,
            lrp=pb.LocalRedirectPolicy(namespace=namespace, name=name),
            revision=change.revision,
        )

    def synced(self, revision: int) -> lb_pb2.LrpEvent:
        return pb.LrpEvent(kind=pb.LrpEvent.KIND_SYNCED, revision=revision)
