"""What the policy says: the resolved policy of an identity, and the
verdict on one packet between two label sets, explained."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flagella.common.errors import NotFound, ResourceExhausted
from flagella.policy.identities import IdentityInfo, Kind, kind_of, parse_prefix
from flagella.policy.labels import SOURCE_CIDR, LabelSet, format_labels
from flagella.policy.resolve import ResolvedPolicy, trace_direction
from flagella.policy.rules import ICMP_PROTOCOLS, Direction, Protocol, Verdict, icmp_type_of
from flagella.policy.state import PolicyState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Trace:
    verdict: Verdict
    egress: Verdict
    ingress: Verdict
    matched_rules: tuple[str, ...]
    explanation: tuple[str, ...]


def resolved_policy(state: PolicyState, ident: int) -> ResolvedPolicy:
    policy = state.policy(ident)
    if policy is None:
        raise NotFound(f"identity {ident} does not exist", field="identity")
    if policy.content.error:
        raise ResourceExhausted(policy.content.error, field="identity")
    return policy


def _trace_info(state: PolicyState, labels: LabelSet) -> IdentityInfo:
    ident = state.identity_of_labels(labels)
    if ident is not None:
        info = state.info(ident)
        if info is not None:
            return info
    kind = kind_of(labels)
    prefix = None
    if kind is Kind.CIDR:
        prefix = next(parse_prefix(lb.key) for lb in labels if lb.source == SOURCE_CIDR)
    return IdentityInfo.make(0, labels, kind, prefix)


def trace_packet(
    state: PolicyState,
    src: LabelSet,
    dst: LabelSet,
    dport: int,
    proto: Protocol,
    *,
    allow_localhost: bool,
) -> Trace:
    if proto is Protocol.ANY:
        proto = Protocol.TCP  # a packet has a protocol: unspecified means TCP
    src_info = _trace_info(state, src)
    dst_info = _trace_info(state, dst)
    rules_src = state.resolver.rules_selecting(src_info)
    rules_dst = state.resolver.rules_selecting(dst_info)
    if proto in ICMP_PROTOCOLS:
        port = f"{proto.name} type {icmp_type_of(dport)}"
    else:
        port = f"{dport}/{proto.name}" if dport else f"any/{proto.name}"
    lines = [
        f"Tracing from {format_labels(src)} (identity {src_info.id or 'none'}) to "
        f"{format_labels(dst)} (identity {dst_info.id or 'none'}) on {port}",
        f"Egress of the source: {len(rules_src)} rule(s) select it",
    ]
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
