"""The adapter to gobgpd's gRPC API (GoBGP's own proto, the subset in
flagella.api.gobgp.v3): typed calls for what the speaker does, on a unix
socket only the datapath reaches.

Export policies: GoBGP applies per-neighbour policies only to route-server
clients, so, as Cilium does, each neighbour gets a policy on the global
export table whose one statement accepts its prefixes (a prefix set, exact
lengths) when the route goes to it (a neighbour set of its address); the
table's default is REJECT, so nothing leaves that no policy lets out. A
policy's name carries a hash of what it allows: changing a neighbour's
prefixes adds the new policy, switches the assignment to it at once, then
deletes the old one.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import AsyncIterable, Iterable, Mapping
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2

from flagella.api.gobgp.v3 import gobgp_pb2 as g
from flagella.api.gobgp.v3 import gobgp_pb2_grpc
from flagella.datapath.bgp.model import PeerSpec

GLOBAL = "global"
POLICY_PREFIX = "flagella-export-"
DESCRIPTION_PREFIX = "flagella "
FAMILIES = {4: g.Family(afi=g.Family.AFI_IP, safi=g.Family.SAFI_UNICAST),
            6: g.Family(afi=g.Family.AFI_IP6, safi=g.Family.SAFI_UNICAST)}  # fmt: skip
FAMILY_NAMES = {4: "ipv4", 6: "ipv6"}
STATES = {
    g.PeerState.UNKNOWN: "unknown",
    g.PeerState.IDLE: "idle",
    g.PeerState.CONNECT: "connect",
    g.PeerState.ACTIVE: "active",
    g.PeerState.OPENSENT: "opensent",
    g.PeerState.OPENCONFIRM: "openconfirm",
    g.PeerState.ESTABLISHED: "established",
}
CALL_TIMEOUT = 10.0
# Reads for the BGP API: an answer within a client's usual deadline.
READ_TIMEOUT = 3.0


def _pack(msg: object) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(msg)  # type: ignore[arg-type]
    return out


def _family_of(prefix: str) -> int:
    return ipaddress.ip_network(prefix, strict=False).version


@dataclass(frozen=True)
class LocalPath:
    prefix: str
    next_hop: str
    path: g.Path  # as gobgpd listed it (what DeletePath is given back)


@dataclass(frozen=True)
class Route:
    prefix: str
    next_hop: str
    family: str
    as_path: tuple[int, ...]
    best: bool
    age_seconds: float
    neighbor: str


@dataclass(frozen=True)
class ExportPolicy:
    name: str
    peer: str
    prefixes: frozenset[str]


def peer_description(spec: PeerSpec) -> str:
    """What a neighbour is compared by (its password is never read back)."""
    return f"{DESCRIPTION_PREFIX}{spec.policy} {spec.fingerprint()}"


def export_policy_name(peer: str, prefixes: Iterable[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(prefixes)).encode()).hexdigest()[:12]
    return f"{POLICY_PREFIX}{peer}-{digest}"


def path_message(prefix: str, next_hop: str) -> g.Path:
    net = ipaddress.ip_network(prefix, strict=False)
    nlri = _pack(g.IPAddressPrefix(prefix=str(net.network_address), prefix_len=net.prefixlen))
    origin = _pack(g.OriginAttribute(origin=0))  # IGP, as Cilium's
    family = FAMILIES[net.version]
    if net.version == 4:
        hop = _pack(g.NextHopAttribute(next_hop=next_hop))
    else:
        hop = _pack(g.MpReachNLRIAttribute(family=family, next_hops=[next_hop], nlris=[nlri]))
    return g.Path(nlri=nlri, pattrs=[origin, hop], family=family)


def _decode_path(path: g.Path) -> tuple[str, str, tuple[int, ...]]:
    """(prefix, next hop, AS path) of a listed path."""
    prefix = next_hop = ""
    as_path: list[int] = []
    nlri = g.IPAddressPrefix()
    if path.nlri.Unpack(nlri):
        prefix = f"{nlri.prefix}/{nlri.prefix_len}"
    for attr in path.pattrs:
        hop = g.NextHopAttribute()
        mp = g.MpReachNLRIAttribute()
        segments = g.AsPathAttribute()
        if attr.Is(hop.DESCRIPTOR) and attr.Unpack(hop):
            next_hop = hop.next_hop
        elif attr.Is(mp.DESCRIPTOR) and attr.Unpack(mp) and mp.next_hops:
            next_hop = mp.next_hops[0]
        elif attr.Is(segments.DESCRIPTOR) and attr.Unpack(segments):
            for seg in segments.segments:
                as_path.extend(seg.numbers)
    return prefix, next_hop, tuple(as_path)


def is_local(path: g.Path) -> bool:
    """A path this speaker originated (AddPath), not one a peer sent."""
    return path.neighbor_ip in ("", "<nil>") and not path.is_from_external


class GobgpClient:
    """gobgpd's API over a channel (a unix socket)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = gobgp_pb2_grpc.GobgpApiStub(channel)

    # --- global ---

    async def get_global(self) -> g.Global:
        resp = await self.stub.GetBgp(g.GetBgpRequest(), timeout=CALL_TIMEOUT)
        glob: g.Global = getattr(resp, "global")  # a Python keyword
        return glob

    async def start(self, asn: int, router_id: str, port: int, addresses: Iterable[str]) -> None:
        """Start BGP, then make the export table refuse what no policy lets
        out (GoBGP's default is to accept)."""
        glob = g.Global(asn=asn, router_id=router_id, listen_port=port,
                        listen_addresses=list(addresses))  # fmt: skip
        await self.stub.StartBgp(g.StartBgpRequest(**{"global": glob}), timeout=CALL_TIMEOUT)
        await self.set_export_assignment([])

    async def stop(self) -> None:
        await self.stub.StopBgp(g.StopBgpRequest(), timeout=CALL_TIMEOUT)

    # --- neighbours ---

    async def list_peers(
        self, *, advertised: bool = False, timeout: float = CALL_TIMEOUT
    ) -> list[g.Peer]:
        call = self.stub.ListPeer(g.ListPeerRequest(enableAdvertised=advertised), timeout=timeout)
        return [r.peer async for r in call]

    async def add_peer(self, spec: PeerSpec, global_asn: int) -> None:
        conf = g.PeerConf(
            neighbor_address=spec.address,
            peer_asn=spec.asn,
            auth_password=spec.password,
            description=peer_description(spec),
        )
        if spec.local_asn != global_asn:
            conf.local_asn = spec.local_asn
        peer = g.Peer(
            conf=conf,
            timers=g.Timers(
                config=g.TimersConfig(
                    connect_retry=spec.connect_retry,
                    hold_time=spec.hold_time,
                    keepalive_interval=spec.keep_alive,
                )
            ),
            transport=g.Transport(remote_port=spec.port),
            afi_safis=[
                g.AfiSafi(config=g.AfiSafiConfig(family=FAMILIES[spec.family], enabled=True))
            ],
        )
        if spec.ebgp_multihop_ttl > 1:
            peer.ebgp_multihop.enabled = True
            peer.ebgp_multihop.multihop_ttl = spec.ebgp_multihop_ttl
        await self.stub.AddPeer(g.AddPeerRequest(peer=peer), timeout=CALL_TIMEOUT)

    async def delete_peer(self, address: str) -> None:
        await self.stub.DeletePeer(g.DeletePeerRequest(address=address), timeout=CALL_TIMEOUT)

    async def reset_out(self, address: str) -> None:
        """Send the peer again what the export policy lets out now."""
        await self.stub.ResetPeer(
            g.ResetPeerRequest(address=address, soft=True, direction=g.ResetPeerRequest.OUT),
            timeout=CALL_TIMEOUT,
        )

    def watch_peers(self) -> AsyncIterable[g.WatchEventResponse]:
        call: AsyncIterable[g.WatchEventResponse] = self.stub.WatchEvent(
            g.WatchEventRequest(peer=g.WatchEventRequest.Peer())
        )
        return call

    # --- paths ---

    async def list_paths(
        self,
        table: g.TableType.ValueType,
        family: int,
        name: str = "",
        timeout: float = CALL_TIMEOUT,
    ) -> list[tuple[g.Destination, g.Path]]:
        call = self.stub.ListPath(
            g.ListPathRequest(table_type=table, name=name, family=FAMILIES[family]),
            timeout=timeout,
        )
        return [(r.destination, p) async for r in call for p in r.destination.paths]

    async def local_paths(self) -> dict[str, LocalPath]:
        out: dict[str, LocalPath] = {}
        for family in FAMILIES:
            for _, path in await self.list_paths(g.GLOBAL, family):
                if is_local(path):
                    prefix, hop, _ = _decode_path(path)
                    out[prefix] = LocalPath(prefix, hop, path)
        return out

    async def add_path(self, prefix: str, next_hop: str) -> None:
        await self.stub.AddPath(
            g.AddPathRequest(table_type=g.GLOBAL, path=path_message(prefix, next_hop)),
            timeout=CALL_TIMEOUT,
        )

    async def delete_path(self, path: LocalPath) -> None:
        msg = path_message(path.prefix, path.next_hop)
        await self.stub.DeletePath(
            g.DeletePathRequest(table_type=g.GLOBAL, family=msg.family, path=msg),
            timeout=CALL_TIMEOUT,
        )

    async def routes(
        self, table: g.TableType.ValueType, family: int, name: str = ""
    ) -> list[Route]:
        out = []
        for _, path in await self.list_paths(table, family, name, READ_TIMEOUT):
            prefix, hop, as_path = _decode_path(path)
            age = path.age.ToSeconds() if path.HasField("age") else 0
            out.append(
                Route(
                    prefix=prefix,
                    next_hop=hop,
                    family=FAMILY_NAMES[family],
                    as_path=as_path,
                    best=path.best,
                    age_seconds=float(age),
                    neighbor="" if path.neighbor_ip in ("", "<nil>") else path.neighbor_ip,
                )
            )
        return out

    # --- export policies ---

    async def export_policies(self) -> dict[str, ExportPolicy]:
        """flagella's export policies gobgpd holds, by name."""
        sets: dict[str, g.DefinedSet] = {}
        for kind in (g.PREFIX, g.NEIGHBOR):
            call = self.stub.ListDefinedSet(
                g.ListDefinedSetRequest(defined_type=kind), timeout=CALL_TIMEOUT
            )
            async for listed in call:
                sets[listed.defined_set.name] = listed.defined_set
        out: dict[str, ExportPolicy] = {}
        call2 = self.stub.ListPolicy(g.ListPolicyRequest(), timeout=CALL_TIMEOUT)
        async for r in call2:
            name = r.policy.name
            if not name.startswith(POLICY_PREFIX):
                continue
            px = sets.get(f"{name}-px")
            nb = sets.get(f"{name}-nb")
            peer = str(ipaddress.ip_network(nb.list[0]).network_address) if nb and nb.list else ""
            prefixes = frozenset(p.ip_prefix for p in px.prefixes) if px else frozenset()
            out[name] = ExportPolicy(name, peer, prefixes)
        return out

    async def assigned_exports(self) -> tuple[list[str], g.RouteAction.ValueType]:
        """The global export table's policies and its default action."""
        call = self.stub.ListPolicyAssignment(
            g.ListPolicyAssignmentRequest(name=GLOBAL, direction=g.EXPORT), timeout=CALL_TIMEOUT
        )
        async for r in call:
            a = r.assignment
            return [p.name for p in a.policies], a.default_action
        return [], g.NONE

    async def add_export_policy(self, name: str, peer: str, prefixes: Iterable[str]) -> None:
        ip = ipaddress.ip_address(peer)
        await self.stub.AddDefinedSet(
            g.AddDefinedSetRequest(
                defined_set=g.DefinedSet(
                    defined_type=g.NEIGHBOR, name=f"{name}-nb", list=[f"{ip}/{ip.max_prefixlen}"]
                )
            ),
            timeout=CALL_TIMEOUT,
        )
        exact = []
        for p in sorted(prefixes):
            net = ipaddress.ip_network(p, strict=False)
            exact.append(
                g.Prefix(
                    ip_prefix=str(net),
                    mask_length_min=net.prefixlen,
                    mask_length_max=net.prefixlen,
                )
            )
        await self.stub.AddDefinedSet(
            g.AddDefinedSetRequest(
                defined_set=g.DefinedSet(defined_type=g.PREFIX, name=f"{name}-px", prefixes=exact)
            ),
            timeout=CALL_TIMEOUT,
        )
        statement = g.Statement(
            name=f"{name}-accept",
            conditions=g.Conditions(
                prefix_set=g.MatchSet(type=g.MatchSet.ANY, name=f"{name}-px"),
                neighbor_set=g.MatchSet(type=g.MatchSet.ANY, name=f"{name}-nb"),
            ),
            actions=g.Actions(route_action=g.ACCEPT),
        )
        await self.stub.AddPolicy(
            g.AddPolicyRequest(policy=g.Policy(name=name, statements=[statement])),
            timeout=CALL_TIMEOUT,
        )

    async def delete_export_policy(self, name: str) -> None:
        await self.stub.DeletePolicy(
            g.DeletePolicyRequest(policy=g.Policy(name=name), all=True), timeout=CALL_TIMEOUT
        )
        for suffix, kind in (("-px", g.PREFIX), ("-nb", g.NEIGHBOR)):
            await self.stub.DeleteDefinedSet(
                g.DeleteDefinedSetRequest(
                    defined_set=g.DefinedSet(defined_type=kind, name=name + suffix), all=True
                ),
                timeout=CALL_TIMEOUT,
            )

    async def set_export_assignment(self, names: Iterable[str]) -> None:
        await self.stub.SetPolicyAssignment(
            g.SetPolicyAssignmentRequest(
                assignment=g.PolicyAssignment(
                    name=GLOBAL,
                    direction=g.EXPORT,
                    policies=[g.Policy(name=n) for n in names],
                    default_action=g.REJECT,
                )
            ),
            timeout=CALL_TIMEOUT,
        )


def peer_counts(peer: g.Peer) -> tuple[int, int, int]:
    """(received, accepted, advertised) over the peer's families."""
    received = accepted = advertised = 0
    for a in peer.afi_safis:
        received += a.state.received
        accepted += a.state.accepted
        advertised += a.state.advertised
    return received, accepted, advertised


def family_names(peer: g.Peer) -> list[str]:
    out = []
    for a in peer.afi_safis:
        fam = a.config.family if a.HasField("config") else a.state.family
        if fam.afi == g.Family.AFI_IP:
            out.append("ipv4-unicast")
        elif fam.afi == g.Family.AFI_IP6:
            out.append("ipv6-unicast")
    return out


def exports_by_peer(policies: Mapping[str, ExportPolicy]) -> dict[str, ExportPolicy]:
    return {p.peer: p for p in policies.values()}


def family_of(prefix: str) -> int:
    return _family_of(prefix)
