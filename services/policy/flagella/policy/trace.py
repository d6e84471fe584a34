"""What the policy says: the resolved policy of an identity, and the
verdict on one packet between two label sets, explained."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from flagella.common.errors import NotFound, ResourceExhausted
from flagella.policy.identities import IdentityInfo, Kind, kind_of, parse_prefix
from flagella.policy.labels import SOURCE_CIDR, LabelSet, format_labels
from flagella.policy.resolve import (
    DirectionTrace,
    ResolvedPolicy,
    port_matches,
    trace_direction,
)
from flagella.policy.rules import (
    ICMP_PROTOCOLS,
    Clause,
    CompiledRule,
    Direction,
    Protocol,
    Verdict,
    icmp_type_of,
)
from flagella.policy.rules.model import ACTION_DENY, ACTION_PASS, TIER_ADMIN, TIER_BASELINE
from flagella.policy.selector import WILDCARD
from flagella.policy.state import PolicyState
from flagella.policy.tiers import first_match

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

    def tiers(
        rules: list[CompiledRule], direction: Direction, peer: IdentityInfo
    ) -> DirectionTrace:
        return trace_tiers(
            rules,
            peer,
            (direction, dport, proto),
            lambda np_rules: trace_direction(
                np_rules, direction, peer, dport, proto, allow_localhost=allow_localhost
            ),
        )

    egress = tiers(rules_src, Direction.EGRESS, dst_info)
    lines += egress.lines
    lines.append(f"Ingress of the destination: {len(rules_dst)} rule(s) select it")
    ingress = tiers(rules_dst, Direction.INGRESS, src_info)
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


def trace_tiers(
    rules: list[CompiledRule],
    peer: IdentityInfo,
    packet: tuple[Direction, int, Protocol],
    np_tier: Callable[[list[CompiledRule]], DirectionTrace],
) -> DirectionTrace:
    """One direction through the tiers (tiers.py): AdminNetworkPolicies,
    the NetworkPolicy tier (np_tier: trace_direction of its rules), the
    baseline."""
    direction, dport, proto = packet
    np_rules = [r for r in rules if not r.tier]

    def np_trace() -> DirectionTrace:
        return np_tier(np_rules)

    if len(np_rules) == len(rules):
        return np_trace()
    name = "ingress" if direction is Direction.INGRESS else "egress"

    def port_ok(key: tuple[int | str, int, Protocol]) -> bool:
        return port_matches(key, dport, proto)

    def decided(found: tuple[CompiledRule, Clause], lines: list[str]) -> DirectionTrace:
        rule, clause = found
        verdict = Verdict.DENY if clause.action == ACTION_DENY else Verdict.ALLOW
        lines.append(f"  {rule.key} {clause.where} ({clause.action}) decides")
        lines.append(f"  {name} {'DENIED' if verdict is Verdict.DENY else 'ALLOWED'}")
        return DirectionTrace(True, verdict, [rule.key], lines)

    lines: list[str] = []
    found = first_match([r for r in rules if r.tier == TIER_ADMIN], direction, peer, port_ok)
    if found is not None and found[1].action == ACTION_DENY:
        return decided(found, lines)
    if found is not None and found[1].action != ACTION_PASS:
        # The datapath takes a deny of identity 0 (any peer) over any
        # peer's allow: an admin Allow cannot override one (tiers.py).
        np = np_trace()
        if np.verdict is Verdict.DENY and _any_peer_denies(np_rules, direction, dport, proto):
            np.lines.append(
                f"  {found[0].key} {found[1].where} (Allow) is overridden by a deny of any peer"
            )
            return np
        return decided(found, lines)
    if found is not None:
        lines.append(f"  {found[0].key} {found[1].where} (Pass): on to the NetworkPolicy tier")
    np = np_trace()
    if np.enforced:
        return DirectionTrace(True, np.verdict, np.deciding, lines + np.lines)
    base = first_match([r for r in rules if r.tier == TIER_BASELINE], direction, peer, port_ok)
    if base is not None:
        return decided(base, lines + np.lines)
    return DirectionTrace(True, Verdict.ALLOW, [], lines + np.lines)


def _any_peer_denies(
    rules: list[CompiledRule], direction: Direction, dport: int, proto: Protocol
) -> bool:
    return any(
        c.direction is direction
        and c.verdict is Verdict.DENY
        and WILDCARD in c.selectors
        and any(port_matches(p, dport, proto) for p in c.ports)
        for r in rules
        for c in r.clauses
    )
