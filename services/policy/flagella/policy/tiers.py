"""AdminNetworkPolicy tiers over one (subject, peer identity, direction):
the final verdict per port segment, as policy-map entries of that peer.

The API's order: AdminNetworkPolicy rules (by priority, then by name; in
one policy, in order) where the first matching rule decides: Allow,
Deny, or Pass (on to the NetworkPolicy tier). What no ANP rule decides
goes to the NetworkPolicy tier when one of its rules selects the subject
in the direction; otherwise BaselineAdminNetworkPolicy rules (in order)
decide; otherwise it is allowed.

Admin peers are always pods (namespace and pod selectors), so the tiers
only ever change entries of specific peer identities, never identity
0's: the datapath takes a deny from either lookup, so the peer's own
entries say the whole verdict on every segment the admin tiers decide
(disjoint allow and deny entries, since the map drops an allow that lies
inside a deny of the same peer), and on the segments they leave to the
NetworkPolicy tier keep that tier's own entries of the peer, clipped.

Ports are segments per protocol: TCP, UDP, SCTP, ICMP, ICMPv6 (the ICMP
type as the port 0x100 | type) and OTHER, every other protocol, which
only a key of every protocol (ANY) can name. Limits, both fail-closed
unless noted: an OTHER segment whose verdict differs from the rest of
the peer's verdict gets no entry (it follows identity 0's entries);
a named port of the NetworkPolicy tier partly overridden keeps its deny
and loses its allow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from flagella.policy.identities import IdentityInfo
from flagella.policy.rules import Clause, CompiledRule, Direction, Protocol
from flagella.policy.rules.model import ACTION_DENY, ACTION_PASS, TIER_BASELINE
from flagella.policy.selector import Selector

# (port, end_port, protocol, direction) as resolve.py's Key4.
Key4 = tuple[int | str, int, int, int]
Names = frozenset[str]
# (tier: 0 admin / 1 baseline, priority, rule name, gress rule index)
Order = tuple[int, int, str, int]
Intervals = tuple[tuple[int, int], ...]
# protocol -> disjoint sorted inclusive port intervals (absent: none).
Region = dict[int, Intervals]

OTHER = 0  # every protocol without a bucket of its own
_BUCKETS = (
    OTHER,
    int(Protocol.TCP),
    int(Protocol.UDP),
    int(Protocol.SCTP),
    int(Protocol.ICMP),
    int(Protocol.ICMPV6),
)
_FULL: Intervals = ((0, 65535),)


def full() -> Region:
    return dict.fromkeys(_BUCKETS, _FULL)


def region_of(key: Key4) -> Region:
    """The segments a numeric key matches (a named key has none here)."""
    port, end, proto = key[0], key[1], key[2]
    if isinstance(port, str):
        return {}
    if proto == int(Protocol.ANY):
        return full()
    if port == 0:
        return {proto: _FULL}
    return {proto: ((port, max(end, port)),)}


def _and(a: Intervals, b: Intervals) -> Intervals:
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _minus(a: Intervals, b: Intervals) -> Intervals:
    out: list[tuple[int, int]] = []
    for start, hi in a:
        lo = start
        for blo, bhi in b:
            if bhi < lo or blo > hi:
                continue
            if blo > lo:
                out.append((lo, blo - 1))
            lo = bhi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return tuple(out)


def _or(a: Intervals, b: Intervals) -> Intervals:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(a + b):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def intersect(a: Region, b: Region) -> Region:
    out = {}
    for p, iv in a.items():
        if p in b:
            both = _and(iv, b[p])
            if both:
                out[p] = both
    return out


def subtract(a: Region, b: Region) -> Region:
    out = {}
    for p, iv in a.items():
        rest = _minus(iv, b[p]) if p in b else iv
        if rest:
            out[p] = rest
    return out


def union(a: Region, b: Region) -> Region:
    out = dict(a)
    for p, iv in b.items():
        out[p] = _or(out[p], iv) if p in out else iv
    return out


def _pack(lo: int, hi: int) -> tuple[int, int]:
    if lo == hi:
        return lo, 0
    return lo, hi


def keys_of(region: Region, direction: int) -> list[Key4]:
    """Keys matching exactly the region (but OTHER, see the module
    documentation): one ANY key for everything."""
    if all(region.get(p) == _FULL for p in _BUCKETS):
        return [(0, 0, int(Protocol.ANY), direction)]
    out: list[Key4] = []
    for p in _BUCKETS[1:]:
        for lo, hi in region.get(p, ()):
            if (lo, hi) == (0, 65535):
                out.append((0, 0, p, direction))
            else:
                port, end = _pack(lo, hi)
                out.append((port, end, p, direction))
    return out


def _put(acc: dict[Key4, set[str]], keys: Iterable[Key4], names: Iterable[str]) -> None:
    for k in keys:
        acc.setdefault(k, set()).update(names)


@dataclass(frozen=True, slots=True)
class AdminClause:
    """One gress rule of an admin tier for one peer: its ports, action and
    the rule's name (for derived_from)."""

    keys: tuple[Key4, ...]
    action: str
    rule: str


def _decide(
    clauses: Sequence[AdminClause],
    undecided: Region,
    direction: int,
    allow: dict[Key4, set[str]],
    deny: dict[Key4, set[str]],
) -> tuple[Region, Region]:
    """First match decides: Allow/Deny segments become entries; returns
    (the Pass segments, what no clause matched)."""
    passed: Region = {}
    for clause in clauses:
        matched: Region = {}
        for key in clause.keys:
            matched = union(matched, intersect(region_of(key), undecided))
        if not matched:
            continue
        undecided = subtract(undecided, matched)
        if clause.action == ACTION_PASS:
            passed = union(passed, matched)
        else:
            target = deny if clause.action == ACTION_DENY else allow
            _put(target, keys_of(matched, direction), (clause.rule,))
        if not undecided:
            break
    return passed, undecided


def _clip(
    entries: Mapping[Key4, Names],
    region: Region,
    direction: int,
    out: dict[Key4, set[str]],
    *,
    keep_partial_names: bool,
) -> None:
    for key, names in entries.items():
        if key[3] != direction:
            continue
        port = key[0]
        if isinstance(port, str):
            if region.get(key[2]) == _FULL or keep_partial_names:
                _put(out, (key,), names)
            continue
        own = region_of(key)
        inside = intersect(own, region)
        if inside == own:
            _put(out, (key,), names)
        elif inside:
            _put(out, keys_of(inside, direction), names)


def evaluate(
    direction: int,
    *,
    admin: Sequence[AdminClause],
    baseline: Sequence[AdminClause],
    np_enforced: bool,
    np_allow: Mapping[Key4, Names],
    np_deny: Mapping[Key4, Names],
) -> tuple[dict[Key4, set[str]], dict[Key4, set[str]]]:
    """The peer's (allow, deny) entries of one direction through the tiers,
    given its NetworkPolicy-tier entries (after deny over allow)."""
    allow: dict[Key4, set[str]] = {}
    deny: dict[Key4, set[str]] = {}
    passed, rest = _decide(admin, full(), direction, allow, deny)
    lower = union(passed, rest)
    if not lower:
        return allow, deny
    if np_enforced:
        # What no admin rule decided: the NetworkPolicy tier's entries of
        # this peer there (identity 0's and the prefix entries stay).
        _clip(np_allow, lower, direction, allow, keep_partial_names=False)
        _clip(np_deny, lower, direction, deny, keep_partial_names=True)
    else:
        # Nothing of the NetworkPolicy tier selects the subject here: the
        # baseline decides, and what it leaves is allowed (identity 0's
        # default-allow entry says so).
        _decide(baseline, lower, direction, allow, deny)
    return allow, deny


class AdminIndex:
    """The admin-tier clauses of one signature by peer selector, in
    evaluation order: AdminNetworkPolicies by priority, then by rule name
    (the API leaves equal priorities undefined; the name makes it
    deterministic), each in order; then the baseline's, in order."""

    def __init__(self, rules: Sequence[CompiledRule]) -> None:
        self.by_selector: dict[Selector, list[tuple[Order, int, AdminClause]]] = {}
        self.directions: set[int] = set()
        for rule in rules:
            tier = 1 if rule.tier == TIER_BASELINE else 0
            for i, clause in enumerate(rule.clauses):
                d = int(clause.direction)
                self.directions.add(d)
                keys = tuple((p, e, int(proto), d) for p, e, proto in clause.ports)
                item = AdminClause(keys, clause.action, rule.key)
                order = (tier, rule.priority, rule.key, i)
                for sel in clause.selectors:
                    self.by_selector.setdefault(sel, []).append((order, d, item))

    def clauses_for(
        self, selectors: AbstractSet[Selector]
    ) -> dict[int, tuple[list[AdminClause], list[AdminClause]]]:
        """Per direction, the (admin, baseline) clauses selecting a peer
        whose matching selectors are given."""
        found: dict[Order, tuple[int, AdminClause]] = {}
        for sel, items in self.by_selector.items():
            if sel in selectors:
                for order, d, item in items:
                    found[order] = (d, item)
        out: dict[int, tuple[list[AdminClause], list[AdminClause]]] = {}
        for order in sorted(found):
            d, item = found[order]
            admin, baseline = out.setdefault(d, ([], []))
            (baseline if order[0] else admin).append(item)
        return out


def first_match(
    rules: Sequence[CompiledRule],
    direction: Direction,
    peer: IdentityInfo,
    matches_port: Callable[[tuple[int | str, int, Protocol]], bool],
) -> tuple[CompiledRule, Clause] | None:
    """The admin-tier gress rule that decides for peer (rules of one tier,
    ordered here as AdminIndex orders them), for traces."""
    for rule in sorted(rules, key=lambda r: (r.priority, r.key)):
        for clause in rule.clauses:
            if clause.direction is not direction:
                continue
            if any(s.matches(peer) for s in clause.selectors) and any(
                matches_port(p) for p in clause.ports
            ):
                return rule, clause
    return None
