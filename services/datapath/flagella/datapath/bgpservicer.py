"""The BGP API of the datapath (GetBgpPeers, GetBgpRoutes,
GetBgpRoutePolicies): proto <-> flagella.datapath.bgp. The handlers are
DatapathServicer's."""

from __future__ import annotations

import ipaddress

from google.protobuf.duration_pb2 import Duration

from flagella.api.datapath.v1 import datapath_pb2
from flagella.common.errors import InvalidArgument
from flagella.datapath.bgp.speaker import Speaker

pb = datapath_pb2

_TABLES = {
    pb.GetBgpRoutesRequest.TABLE_UNSPECIFIED: "",
    pb.GetBgpRoutesRequest.TABLE_ADVERTISED: "advertised",
    pb.GetBgpRoutesRequest.TABLE_RECEIVED: "received",
    pb.GetBgpRoutesRequest.TABLE_LOCAL: "local",
}


def _duration(seconds: float) -> Duration:
    out = Duration()
    out.FromNanoseconds(int(seconds * 1e9))
    return out


def speaker_to_proto(speaker: Speaker | None) -> datapath_pb2.BgpSpeaker:
    if speaker is None:
        return pb.BgpSpeaker(state="disabled", last_error="no lb service (--lb-address)")
    want = speaker.desired
    return pb.BgpSpeaker(
        state=speaker.state,
        local_asn=want.asn if want else 0,
        router_id=want.router_id if want else "",
        listen_port=speaker.listen_port,
        pid=speaker.gobgpd.pid if speaker.gobgpd.running else 0,
        restarts=speaker.restarts,
        last_error=speaker.last_error,
        policies=list(want.policies) if want else [],
        not_applied=speaker.not_applied(),
    )


async def get_peers(speaker: Speaker | None) -> datapath_pb2.GetBgpPeersResponse:
    out = pb.GetBgpPeersResponse(speaker=speaker_to_proto(speaker))
    if speaker is None:
        return out
    for p in await speaker.peers():
        peer = out.peers.add(
            peer_address=p.address,
            peer_port=p.port,
            peer_asn=p.asn,
            local_asn=p.local_asn,
            session_state=p.state,
            prefixes_received=p.received,
            prefixes_accepted=p.accepted,
            prefixes_advertised=p.advertised,
            last_error=p.last_error,
            policy=p.policy,
            hold_time_seconds=p.hold_time,
            keep_alive_time_seconds=p.keep_alive,
            peer_router_id=p.peer_router_id,
            families=p.families,
            has_password=p.has_password,
        )
        if p.state == "established":
            peer.uptime.CopyFrom(_duration(p.uptime_s))
    return out


async def get_routes(
    speaker: Speaker | None, request: datapath_pb2.GetBgpRoutesRequest
) -> datapath_pb2.GetBgpRoutesResponse:
    if request.table not in _TABLES:
        raise InvalidArgument(f"{request.table} is not a table", field="table")
    if request.family not in ("", "ipv4", "ipv6"):
        raise InvalidArgument(f"{request.family!r} is not ipv4 or ipv6", field="family")
    peer = request.peer_address
    if peer:
        try:
            peer = str(ipaddress.ip_address(peer))
        except ValueError:
            raise InvalidArgument(f"{peer!r} is not an IP address", field="peer_address") from None
    out = pb.GetBgpRoutesResponse()
    if speaker is None:
        return out
    for view in await speaker.routes(_TABLES[request.table], request.family, peer):
        r = view.route
        out.routes.add(
            prefix=r.prefix,
            next_hop=r.next_hop,
            table=view.table,
            peer_address=view.peer,
            family=r.family,
            as_path=list(r.as_path),
            best=r.best,
            age=_duration(r.age_seconds),
        )
    return out


async def get_route_policies(speaker: Speaker | None) -> datapath_pb2.GetBgpRoutePoliciesResponse:
    out = pb.GetBgpRoutePoliciesResponse(default_export_action="reject")
    if speaker is None:
        return out
    for p in await speaker.route_policies():
        out.policies.add(
            name=p.name, peer_address=p.peer, direction="export", prefixes=sorted(p.prefixes)
        )
    return out
