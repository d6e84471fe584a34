"""BGP peering policies over gRPC: proto <-> domain (flagella.lb.bgp) and
the WatchBgpPeeringPolicies messages. The handlers are LbServicer's."""

from __future__ import annotations

from flagella.api.lb.v1 import lb_pb2
from flagella.common.sync import Change
from flagella.lb.bgp import (
    PeeringPolicy,
    RawNeighbor,
    RawPolicy,
    RawSelector,
    RawVirtualRouter,
    Selector,
)

pb = lb_pb2


def raw_selector(msg: lb_pb2.LabelSelector) -> RawSelector:
    return RawSelector(
        dict(msg.match_labels),
        [(r.key, r.operator, list(r.values)) for r in msg.match_expressions],
    )


def raw_policy(msg: lb_pb2.BgpPeeringPolicy) -> RawPolicy:
    return RawPolicy(
        name=msg.name,
        node_selector=raw_selector(msg.node_selector) if msg.HasField("node_selector") else None,
        virtual_routers=[
            RawVirtualRouter(
                local_asn=vr.local_asn,
                export_pod_cidr=vr.export_pod_cidr,
                service_selector=(
                    raw_selector(vr.service_selector) if vr.HasField("service_selector") else None
                ),
                router_id=vr.router_id,
                neighbors=[
                    RawNeighbor(
                        peer_address=n.peer_address,
                        peer_asn=n.peer_asn,
                        peer_port=n.peer_port,
                        hold_time=n.hold_time_seconds,
                        keep_alive=n.keep_alive_time_seconds,
                        connect_retry=n.connect_retry_time_seconds,
                        ebgp_multihop_ttl=n.ebgp_multihop_ttl,
                        password=n.password,
                        auth_secret_ref=n.auth_secret_ref,
                    )
                    for n in vr.neighbors
                ],
            )
            for vr in msg.virtual_routers
        ],
    )


def _selector_pb(out: lb_pb2.LabelSelector, sel: Selector) -> None:
    out.SetInParent()
    out.match_labels.update(dict(sel.match_labels))
    out.match_expressions.extend(
        pb.LabelSelectorRequirement(key=r.key, operator=r.operator, values=r.values)
        for r in sel.match_expressions
    )


def policy_to_proto(
    policy: PeeringPolicy, *, with_passwords: bool = False
) -> lb_pb2.BgpPeeringPolicy:
    """The policy as answers show it; with_passwords only on the nodes'
    stream."""
    out = pb.BgpPeeringPolicy(name=policy.name, revision=policy.revision, source=policy.source)
    if policy.node_selector is not None:
        _selector_pb(out.node_selector, policy.node_selector)
    for vr in policy.virtual_routers:
        v = out.virtual_routers.add(
            local_asn=vr.local_asn, export_pod_cidr=vr.export_pod_cidr, router_id=vr.router_id
        )
        if vr.service_selector is not None:
            _selector_pb(v.service_selector, vr.service_selector)
        for n in vr.neighbors:
            v.neighbors.add(
                peer_address=n.peer_address,
                peer_asn=n.peer_asn,
                peer_port=n.peer_port,
                hold_time_seconds=n.hold_time,
                keep_alive_time_seconds=n.keep_alive,
                connect_retry_time_seconds=n.connect_retry,
                ebgp_multihop_ttl=n.ebgp_multihop_ttl,
                password=n.password if with_passwords else "",
                auth_secret_ref=n.auth_secret_ref,
                has_password=bool(n.password),
            )
    return out


class BgpPolicyEvents:
    """The WatchBgpPeeringPolicies messages of the policies table's changes
    (the nodes' stream: passwords included)."""

    def reset(self, revision: int) -> lb_pb2.BgpPeeringPolicyEvent:
        return pb.BgpPeeringPolicyEvent(kind=pb.BgpPeeringPolicyEvent.KIND_RESET, revision=revision)

    async def upsert(self, change: Change[str, PeeringPolicy]) -> lb_pb2.BgpPeeringPolicyEvent:
        assert change.record is not None
        return pb.BgpPeeringPolicyEvent(
            kind=pb.BgpPeeringPolicyEvent.KIND_UPSERT,
            policy=policy_to_proto(change.record, with_passwords=True),
            revision=change.revision,
        )

    async def delete(self, change: Change[str, PeeringPolicy]) -> lb_pb2.BgpPeeringPolicyEvent:
        return pb.BgpPeeringPolicyEvent(
            kind=pb.BgpPeeringPolicyEvent.KIND_DELETE,
            policy=pb.BgpPeeringPolicy(name=change.key),
            revision=change.revision,
        )

    def synced(self, revision: int) -> lb_pb2.BgpPeeringPolicyEvent:
        return pb.BgpPeeringPolicyEvent(
            kind=pb.BgpPeeringPolicyEvent.KIND_SYNCED, revision=revision
        )
