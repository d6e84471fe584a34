"""Policy resolution: from rules and identities to policy-map entries.

Semantics (Cilium's default enforcement mode):
- A direction of an identity is enforced when at least one rule selecting
  it has rules (allow or deny) in that direction, or enforces it explicitly
  (a Kubernetes policyTypes entry). A direction not enforced allows all:
  one entry (identity 0, port 0, ANY) says so.
- In an enforced direction only what an allow entry matches passes
  (default deny), and deny beats allow.
- Ingress from the local host (identity 1) is allowed when ingress is
  enforced (Cilium's allow-localhost=always), unless a deny rule says
  otherwise.

Entries are keyed (peer identity, port, end_port, protocol, direction), with
identity 0 meaning any identity, port 0 any port, end_port > 0 an inclusive
range and protocol ANY any protocol (ANY only ever comes with port 0: a
port with ANY is expanded to TCP, UDP and SCTP). Deny over allow is made
explicit so that a datapath that picks the most specific matching entry
(exact identity before 0, narrower port range before wider, a protocol
before ANY; deny on a tie) gets it right: wherever an allow entry and a deny
entry overlap, the overlap is added as a deny entry, and an allow entry a
deny entry covers is dropped.

Incremental: identities with the same set of selecting rules (a signature)
share one computed policy; the entries are grouped by peer identity, so a
new or removed identity recomputes only its own group in the signatures
whose selectors select it, and a changed rule recomputes only the
signatures that contain it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from flagella.policy.identities import HOST, IdentityInfo, Kind
from flagella.policy.prefixes import PrefixEntry, flatten
from flagella.policy.rules import (
    Clause,
    CompiledRule,
    Direction,
    Protocol,
    Verdict,
)
from flagella.policy.selector import WILDCARD, LabelSelector, Selector, SelectorCache
from flagella.policy.tiers import AdminIndex, evaluate

DEFAULT_BUDGET = 16384

# derived_from of the entries no rule made.
DEFAULT_ALLOW = "(no rule selects this direction: allow all)"
ALLOW_LOCALHOST = "(allow-localhost)"

# (port, end_port, protocol, direction), plain ints (hashed a lot); the port
# is a str for a named port, kept symbolic (see _intersect_named).
Key4 = tuple[int | str, int, int, int]
Group = tuple[dict[Key4, frozenset[str]], dict[Key4, frozenset[str]]]  # (allow, deny)


class PolicyEntry(NamedTuple):
    identity: int
    port: int
    end_port: int
    protocol: Protocol
    direction: Direction
    verdict: Verdict
    derived_from: tuple[str, ...] = ()
    # A named port (port and end_port 0), resolved by the datapath.
    port_name: str = ""


_PROTOCOL = {int(p): p for p in Protocol}
_DIRECTION = {int(d): d for d in Direction}
_VERDICT = {int(v): v for v in Verdict}
_ANY = int(Protocol.ANY)
_INGRESS = int(Direction.INGRESS)
_EGRESS = int(Direction.EGRESS)


# weakref_slot: the servicer's ContentCache keeps bytes per content only
# while the content lives.
@dataclass(frozen=True, slots=True, weakref_slot=True)
class PolicyContent:
    """What a resolved policy says; shared by the identities of one
    signature."""

    ingress_enforced: bool
    egress_enforced: bool
    entries: tuple[PolicyEntry, ...]
    # Set when the entries would exceed the budget: the content is then
    # fail-closed (both directions enforced, no entries).
    error: str = ""
    # Kubernetes ipBlocks over addresses (prefixes.py).
    prefix_entries: tuple[PrefixEntry, ...] = ()
    # The rules enforcing each direction: what a packet no entry allows is
    # denied by (named by the datapath's AUDIT and policy-drop flows).
    ingress_rules: tuple[str, ...] = ()
    egress_rules: tuple[str, ...] = ()
    # Rules with Kubernetes ipBlocks select the identity: what it gets
    # depends on --k8s-ipblock-mode, which a resumed stream cannot know the
    # client saw (streams.py resends such policies).
    ipblock_rules: bool = False
    # Rules with toServices select the identity: their prefix entries follow
    # the lb services, which etcd's history does not hold (a resumed stream
    # resends such policies too).
    service_rules: bool = False
    # Egress toFQDNs select the identity: its DNS goes through the node's
    # DNS proxy (which learns what the names resolve to).
    dns_proxy: bool = False
    # rules.dns of those rules (FQDNSelector keys), sorted; empty: any name.
    dns_rules: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ResolvedPolicy:
    identity: int
    revision: int
    content: PolicyContent


# --- port arithmetic ---


def _range(port: int, end: int) -> tuple[int, int]:
    if port == 0:
        return 0, 65535
    return port, end if end > port else port


def _pack(lo: int, hi: int) -> tuple[int, int]:
    if lo == 0 and hi == 65535:
        return 0, 0
    if lo == hi:
        return lo, 0
    return lo, hi


def intersect(a: Key4, b: Key4) -> Key4 | None:
    """The keys both a and b match, as one key, or None."""
    if a[3] != b[3]:
        return None
    pa, pb = a[2], b[2]
    if pa == _ANY:
        proto = pb
    elif pb in (_ANY, pa):
        proto = pa
    else:
        return None
    a0, b0 = a[0], b[0]
    if isinstance(a0, str) or isinstance(b0, str):
        return _intersect_named(a0, b0, proto, a[3])
    alo, ahi = _range(a0, a[1])
    blo, bhi = _range(b0, b[1])
    lo, hi = max(alo, blo), min(ahi, bhi)
    if lo > hi:
        return None
    port, end = _pack(lo, hi)
    return port, end, proto, a[3]


def _intersect_named(a: int | str, b: int | str, proto: int, direction: int) -> Key4 | None:
    """A named port's overlap with a name or a number. Its number is only
    known per endpoint (in the datapath), so the overlap with a port number
    is not known here: None, and the datapath's map, which applies deny
    over allow to the resolved numbers itself, decides it. With every port
    (0) or the same name it is the named key."""
    if isinstance(a, str) and isinstance(b, str):
        return (a, 0, proto, direction) if a == b else None
    name, other = (a, b) if isinstance(a, str) else (b, a)
    return (name, 0, proto, direction) if other == 0 else None


def port_matches(key: tuple[int | str, int, Protocol], dport: int, proto: Protocol) -> bool:
    """Whether a port key matches dport/proto; a named port never does here
    (its number is the endpoint's, which a trace by labels does not know)."""
    port = key[0]
    if isinstance(port, str):
        return False
    if key[2] != Protocol.ANY and key[2] != proto:
        return False
    lo, hi = _range(port, key[1])
    return lo <= dport <= hi if port else True


def _add(acc: dict[Key4, set[str]], keys: Iterable[Key4], name: str) -> None:
    for k in keys:
        s = acc.get(k)
        if s is None:
            acc[k] = {name}
        else:
            s.add(name)


def _freeze(acc: dict[Key4, set[str]]) -> dict[Key4, frozenset[str]]:
    return {k: frozenset(v) for k, v in acc.items()}


def _precedence(
    allow: dict[Key4, frozenset[str]],
    deny: dict[Key4, frozenset[str]],
    other_allow: dict[Key4, frozenset[str]],
    other_deny: dict[Key4, frozenset[str]],
) -> Group:
    """Final entries of one peer identity's group given its raw allow/deny
    entries and the wildcard group's (other_*)."""
    if not deny and not other_deny:
        return allow, {}
    out_deny: dict[Key4, set[str]] = {k: set(v) for k, v in deny.items()}
    denies = list(deny.items()) + list(other_deny.items())
    for a in allow:
        for d, names in denies:
            i = intersect(a, d)
            if i is not None:
                out_deny.setdefault(i, set()).update(names)
    if deny:
        for a in other_allow:
            for d, names in deny.items():
                i = intersect(a, d)
                if i is not None:
                    out_deny.setdefault(i, set()).update(names)
    final_deny = _freeze(out_deny)
    return {k: v for k, v in allow.items() if k not in final_deny}, final_deny


def _add_dir(
    acc: dict[Key4, set[str]], entries: dict[Key4, frozenset[str]], direction: int
) -> None:
    for k, names in entries.items():
        if k[3] == direction:
            acc.setdefault(k, set()).update(names)


def _clause_keys(clause: Clause) -> tuple[Key4, ...]:
    d = int(clause.direction)
    return tuple((p, e, int(proto), d) for p, e, proto in clause.ports)


class SigPolicy:
    """The computed policy of one signature (a set of selecting rules)."""

    def __init__(self, resolver: Resolver, sig: frozenset[str]) -> None:
        self.resolver = resolver
        self.sig = sig
        every = [resolver.rules[k] for k in sorted(sig)]
        rules = [r for r in every if not r.tier]
        self.np_enforced = {
            _INGRESS: any(r.enforces_ingress for r in rules),
            _EGRESS: any(r.enforces_egress for r in rules),
        }
        # AdminNetworkPolicy tiers (tiers.py); empty in the common case.
        self.admin = AdminIndex([r for r in every if r.tier])
        self.ingress_enforced = self.np_enforced[_INGRESS] or _INGRESS in self.admin.directions
        self.egress_enforced = self.np_enforced[_EGRESS] or _EGRESS in self.admin.directions
        tiered = tuple(r.key for r in every if r.tier)
        self.enforcing = (
            tuple(r.key for r in rules if r.enforces_ingress)
            + (tiered if _INGRESS in self.admin.directions else ()),
            tuple(r.key for r in rules if r.enforces_egress)
            + (tiered if _EGRESS in self.admin.directions else ()),
        )
        self.localhost = resolver.allow_localhost and self.np_enforced[_INGRESS]
        # fromRequires / toRequires of every rule of the signature, which
        # every endpoint selector of every rule of it must meet too.
        self.requires = {d: tuple(s for r in rules for s in r.requirements(d)) for d in Direction}
        # selector -> (clause, its keys, whether the requirements narrow it)
        self.by_selector: dict[Selector, list[tuple[Clause, tuple[Key4, ...], bool]]] = {}
        allow0: dict[Key4, set[str]] = {}
        deny0: dict[Key4, set[str]] = {}
        for rule in rules:
            for clause in rule.clauses:
                keys = _clause_keys(clause)
                narrowed = bool(self.requires[clause.direction])
                for sel in clause.selectors:
                    if sel is WILDCARD:
                        _add(
                            allow0 if clause.verdict is Verdict.ALLOW else deny0, keys, clause.rule
                        )
                    else:
                        self.by_selector.setdefault(sel, []).append(
                            (clause, keys, narrowed and sel in clause.endpoint_selectors)
                        )
        if not self.np_enforced[_INGRESS]:
            _add(allow0, [(0, 0, _ANY, _INGRESS)], DEFAULT_ALLOW)
        if not self.np_enforced[_EGRESS]:
            _add(allow0, [(0, 0, _ANY, _EGRESS)], DEFAULT_ALLOW)
        # Kubernetes ipBlocks over addresses depend on the rules only.
        self.ipblock_rules = any(r.has_ipblocks for r in rules)
        self.service_rules = any(r.has_services for r in rules)
        self.dns_rules = tuple(sorted({k for r in rules for k in r.dns}))
        self.dns_proxy = any(r.fqdns or r.dns for r in rules)
        self.prefix_entries = flatten(c for r in rules for c in r.clauses if c.blocks)
        self.raw_allow0 = _freeze(allow0)
        self.raw_deny0 = _freeze(deny0)
        self.group0 = _precedence(self.raw_allow0, self.raw_deny0, {}, {})
        self.groups: dict[int, Group] = {}
        self.count = sum(map(len, self.group0)) + len(self.prefix_entries)
        self.version = 0
        self._content: PolicyContent | None = None
        self._stale: set[int] = set()
        self._compute_all()

    def _group_ids(self) -> set[int]:
        cache = self.resolver.selectors
        ids: set[int] = set()
        for sel in self.by_selector:
            ids |= cache.selections(sel)
        for sel in self.admin.by_selector:
            ids |= cache.selections(sel)
        if self.localhost:
            ids.add(HOST)
        return ids

    def _raw(self, ident: int) -> tuple[dict[Key4, frozenset[str]], dict[Key4, frozenset[str]]]:
        allow: dict[Key4, set[str]] = {}
        deny: dict[Key4, set[str]] = {}
        sels = self.resolver.selectors.selectors_of(ident)
        by_sel = self.by_selector
        if len(sels) < len(by_sel):
            pairs = (by_sel[s] for s in sels if s in by_sel)
        else:
            pairs = (cl for s, cl in by_sel.items() if s in sels)
        for clauses in pairs:
            for clause, keys, narrowed in clauses:
                if narrowed and not self._meets_requires(ident, clause.direction):
                    continue
                _add(allow if clause.verdict is Verdict.ALLOW else deny, keys, clause.rule)
        if ident == HOST and self.localhost:
            _add(allow, [(0, 0, _ANY, _INGRESS)], ALLOW_LOCALHOST)
        return _freeze(allow), _freeze(deny)

    def _meets_requires(self, ident: int, direction: Direction) -> bool:
        info = self.resolver.identities.get(ident)
        return info is not None and all(s.matches(info) for s in self.requires[direction])

    def _set_group(self, ident: int, group: Group | None) -> None:
        old = self.groups.pop(ident, None)
        if old is not None:
            self.count -= len(old[0]) + len(old[1])
        if group is not None and (group[0] or group[1]):
            self.groups[ident] = group
            self.count += len(group[0]) + len(group[1])

    def _compute_ident(self, ident: int) -> None:
        allow, deny = self._raw(ident)
        group: Group | None = None
        if allow or deny:
            group = _precedence(allow, deny, self.raw_allow0, self.raw_deny0)
        if self.admin.by_selector:
            group = self._admin_group(ident, group)
        self._set_group(ident, group)

    def _admin_group(self, ident: int, group: Group | None) -> Group | None:
        """The NetworkPolicy tier's group of a peer through the admin tiers
        of the directions whose admin rules select the peer."""
        sels = self.resolver.selectors.selectors_of(ident)
        found = self.admin.clauses_for(sels)
        if not found:
            return group
        np_allow, np_deny = group if group is not None else ({}, {})
        out_allow: dict[Key4, set[str]] = {}
        out_deny: dict[Key4, set[str]] = {}
        for d in (_INGRESS, _EGRESS):
            if d not in found:
                _add_dir(out_allow, np_allow, d)
                _add_dir(out_deny, np_deny, d)
                continue
            admin, baseline = found[d]
            a, dn = evaluate(
                d,
                admin=admin,
                baseline=baseline,
                np_enforced=self.np_enforced[d],
                np_allow=np_allow,
                np_deny=np_deny,
            )
            for k, names in a.items():
                out_allow.setdefault(k, set()).update(names)
            for k, names in dn.items():
                out_deny.setdefault(k, set()).update(names)
        return _freeze(out_allow), _freeze(out_deny)

    def _compute_all(self) -> None:
        for ident in self._group_ids():
            self._compute_ident(ident)

    def invalidate(self, idents: Iterable[int]) -> None:
        self._stale.update(idents)

    def refresh(self) -> None:
        if not self._stale:
            return
        stale, self._stale = self._stale, set()
        for ident in stale:
            self._compute_ident(ident)
        self.version += 1
        self._content = None

    def content(self, budget: int) -> PolicyContent:
        self.refresh()
        if self._content is not None:
            return self._content
        if self.count > budget:
            self._content = PolicyContent(
                ingress_enforced=True,
                egress_enforced=True,
                entries=(),
                error=(
                    f"policy needs {self.count} entries, more than the per-endpoint budget "
                    f"of {budget}: failing closed"
                ),
                ingress_rules=self.enforcing[0],
                egress_rules=self.enforcing[1],
            )
            return self._content
        raw: list[tuple[int, int, int, int, int, int, tuple[str, ...], str]] = []
        allow_v, deny_v = int(Verdict.ALLOW), int(Verdict.DENY)
        for ident, (allow, deny) in [(0, self.group0), *self.groups.items()]:
            for verdict, group in ((allow_v, allow), (deny_v, deny)):
                for k, names in group.items():
                    port = k[0]
                    if isinstance(port, str):
                        raw.append((ident, 0, 0, k[2], k[3], verdict, tuple(sorted(names)), port))
                    else:
                        raw.append(
                            (ident, port, k[1], k[2], k[3], verdict, tuple(sorted(names)), "")
                        )
        raw.sort()
        entries = [
            PolicyEntry(i, p, e, _PROTOCOL[pr], _DIRECTION[d], _VERDICT[v], n, name)
            for i, p, e, pr, d, v, n, name in raw
        ]
        self._content = PolicyContent(
            self.ingress_enforced,
            self.egress_enforced,
            tuple(entries),
            prefix_entries=self.prefix_entries,
            ingress_rules=self.enforcing[0],
            egress_rules=self.enforcing[1],
            ipblock_rules=self.ipblock_rules,
            service_rules=self.service_rules,
            dns_proxy=self.dns_proxy,
            dns_rules=self.dns_rules,
        )
        return self._content


@dataclass(frozen=True, slots=True)
class SelectorUse:
    """One selector in use: "peer" (from/to a rule's clauses) or "subject"
    (a rule's endpointSelector), the identities it selects, the rules."""

    selector: str
    role: str
    identities: tuple[int, ...]
    rules: tuple[str, ...]


class Resolver:
    """Rules and identities in; resolved policies out, incrementally."""

    def __init__(self, *, budget: int = DEFAULT_BUDGET, allow_localhost: bool = True) -> None:
        self.budget = budget
        self.allow_localhost = allow_localhost
        self.selectors = SelectorCache()
        self.rules: dict[str, CompiledRule] = {}
        self._rules_by_subject: dict[LabelSelector, set[str]] = {}
        self._peer_users: dict[Selector, set[str]] = {}
        # identity -> signature (rule keys selecting it)
        self._sig_of: dict[int, frozenset[str]] = {}
        self._members: dict[frozenset[str], set[int]] = {}
        self._sigs_with_rule: dict[str, set[frozenset[str]]] = {}
        self._computed: dict[frozenset[str], SigPolicy] = {}
        self._dirty: set[int] = set()
        # Host policies (nodeSelector rules), by key.
        self.host_rules: dict[str, CompiledRule] = {}
        # Whether any node's host policy may have changed since the last
        # take_host_dirty (a host rule, or what a host rule's peer selects):
        # the host policy streams look again only then.
        self._host_dirty = False

    # --- inputs ---

    @property
    def identities(self) -> dict[int, IdentityInfo]:
        return self.selectors.identities

    def add_identity(self, info: IdentityInfo) -> None:
        changed = self.selectors.add_identity(info)
        self._peers_changed(changed, (info.id,))
        self._resubject(info.id)
        self._dirty.add(info.id)

    def remove_identity(self, ident: int) -> None:
        changed = self.selectors.remove_identity(ident)
        self._peers_changed(changed, (ident,))
        self._set_sig(ident, None)
        self._dirty.add(ident)

    def put_rule(self, rule: CompiledRule) -> None:
        affected: set[int] = set()
        old = self.rules.pop(rule.key, None)
        if old is not None:
            affected |= self._unregister(old)
        self.rules[rule.key] = rule
        affected |= self._register(rule)
        self._rules_changed(rule.key, affected)

    def delete_rule(self, key: str) -> bool:
        old = self.rules.pop(key, None)
        if old is None:
            return False
        affected = self._unregister(old)
        self._rules_changed(key, affected)
        return True

    def selectors_in_use(self) -> list[SelectorUse]:
        """Every selector rules use (Cilium's selector cache, as
        GetPolicySelectors shows it): what it selects now and who uses it."""
        out = []
        for roles, users in (("peer", self._peer_users), ("subject", self._rules_by_subject)):
            for sel, keys in users.items():
                out.append(
                    SelectorUse(
                        selector=str(sel),
                        role=roles,
                        identities=tuple(sorted(self.selectors.selections(sel))),
                        rules=tuple(sorted(keys)),
                    )
                )
        out.sort(key=lambda u: (u.selector, u.role))
        return out

    def _register(self, rule: CompiledRule) -> set[int]:
        for sel in rule.peer_selectors:
            self.selectors.add_user(sel)
            self._peer_users.setdefault(sel, set()).add(rule.key)
        if rule.host:
            # Selects nodes' host endpoints (host_content), no identity.
            self.host_rules[rule.key] = rule
            self._host_dirty = True
            return set()
        self.selectors.add_user(rule.subject)
        self._rules_by_subject.setdefault(rule.subject, set()).add(rule.key)
        return set(self.selectors.selections(rule.subject))

    def _unregister(self, rule: CompiledRule) -> set[int]:
        affected: set[int] = set()
        if rule.host:
            self.host_rules.pop(rule.key, None)
            self._host_dirty = True
        else:
            affected = set(self.selectors.selections(rule.subject))
            users = self._rules_by_subject.get(rule.subject)
            if users is not None:
                users.discard(rule.key)
                if not users:
                    del self._rules_by_subject[rule.subject]
            self.selectors.remove_user(rule.subject)
        for sel in rule.peer_selectors:
            peer_users = self._peer_users.get(sel)
            if peer_users is not None:
                peer_users.discard(rule.key)
                if not peer_users:
                    del self._peer_users[sel]
            self.selectors.remove_user(sel)
        return affected

    def _rules_changed(self, key: str, affected: set[int]) -> None:
        # Signatures that contain the rule: their content changed.
        for sig in list(self._sigs_with_rule.get(key, ())):
            self._computed.pop(sig, None)
            self._dirty.update(self._members.get(sig, ()))
        for ident in affected:
            self._resubject(ident)

    def _peers_changed(self, selectors: Iterable[Selector], idents: Iterable[int]) -> None:
        sigs: set[frozenset[str]] = set()
        host_rules = self.host_rules
        for sel in selectors:
            for key in self._peer_users.get(sel, ()):
                sigs.update(self._sigs_with_rule.get(key, ()))
                if key in host_rules:
                    self._host_dirty = True
        if not sigs:
            return
        idents = tuple(idents)
        for sig in sigs:
            computed = self._computed.get(sig)
            if computed is not None:
                computed.invalidate(idents)
            self._dirty.update(self._members.get(sig, ()))

    def _eligible(self, rule: CompiledRule, info: IdentityInfo) -> bool:
        if info.kind is Kind.GLOBAL:
            return True
        return info.kind is Kind.RESERVED and rule.selects_reserved

    def _resubject(self, ident: int) -> None:
        info = self.identities.get(ident)
        if info is None:
            self._set_sig(ident, None)
            return
        keys: set[str] = set()
        if info.kind is not Kind.CIDR:
            for sel in self.selectors.selectors_of(ident):
                if isinstance(sel, LabelSelector):
                    for key in self._rules_by_subject.get(sel, ()):
                        if self._eligible(self.rules[key], info):
                            keys.add(key)
        self._set_sig(ident, frozenset(keys))

    def _set_sig(self, ident: int, sig: frozenset[str] | None) -> None:
        old = self._sig_of.get(ident)
        if old == sig:
            return
        self._dirty.add(ident)
        if old is not None:
            members = self._members[old]
            members.discard(ident)
            if not members:
                del self._members[old]
                self._computed.pop(old, None)
                for key in old:
                    with_rule = self._sigs_with_rule.get(key)
                    if with_rule is not None:
                        with_rule.discard(old)
                        if not with_rule:
                            del self._sigs_with_rule[key]
            del self._sig_of[ident]
        if sig is not None:
            self._sig_of[ident] = sig
            new_members = self._members.get(sig)
            if new_members is None:
                self._members[sig] = {ident}
                for key in sig:
                    self._sigs_with_rule.setdefault(key, set()).add(sig)
            else:
                new_members.add(ident)

    # --- outputs ---

    def take_dirty(self) -> set[int]:
        """Identities whose policy may have changed since the last call."""
        dirty, self._dirty = self._dirty, set()
        return dirty

    def take_host_dirty(self) -> bool:
        """Whether a node's host policy may have changed since the last call."""
        dirty, self._host_dirty = self._host_dirty, False
        return dirty

    def signature(self, ident: int) -> frozenset[str] | None:
        return self._sig_of.get(ident)

    def _sig_policy(self, sig: frozenset[str]) -> SigPolicy:
        computed = self._computed.get(sig)
        if computed is None:
            computed = SigPolicy(self, sig)
            self._computed[sig] = computed
        return computed

    def content(self, ident: int) -> PolicyContent | None:
        """The resolved policy of a known identity (None when unknown)."""
        sig = self._sig_of.get(ident)
        if sig is None:
            return None
        return self._sig_policy(sig).content(self.budget)

    def entry_count(self, ident: int) -> int:
        sig = self._sig_of.get(ident)
        if sig is None:
            return 0
        policy = self._sig_policy(sig)
        policy.refresh()
        return policy.count

    def rules_selecting(self, info: IdentityInfo) -> list[CompiledRule]:
        """Rules whose endpoint selector selects info (need not be known)."""
        if info.kind is Kind.CIDR:
            return []
        out = []
        for sel in self.selectors.matching(info):
            if not isinstance(sel, LabelSelector):
                continue
            for key in self._rules_by_subject.get(sel, ()):
                rule = self.rules[key]
                if self._eligible(rule, info):
                    out.append(rule)
        return sorted(out, key=lambda r: r.key)

    def host_content(self, host: IdentityInfo) -> tuple[PolicyContent, frozenset[str]] | None:
        """The host policy of a node whose host endpoint has host's labels:
        the rules whose nodeSelector selects it, resolved as a signature
        (peers as for pods), and their keys; None: no rule selects it.
        Computed afresh (host rules are few; nothing caches a signature no
        identity has)."""
        sig = frozenset(k for k, r in self.host_rules.items() if r.subject.matches(host))
        if not sig:
            return None
        return SigPolicy(self, sig).content(self.budget), sig

    def iter_signatures(self) -> Iterator[tuple[frozenset[str], set[int]]]:
        return iter(self._members.items())


# --- trace ---


@dataclass
class DirectionTrace:
    enforced: bool
    verdict: Verdict
    deciding: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def trace_direction(
    rules: list[CompiledRule],
    direction: Direction,
    peer: IdentityInfo,
    dport: int,
    proto: Protocol,
    *,
    allow_localhost: bool,
) -> DirectionTrace:
    """The verdict for traffic in one direction of an endpoint selected by
    rules, from/to peer on dport/proto."""
    name = "ingress" if direction is Direction.INGRESS else "egress"
    enforcing = [
        r.key
        for r in rules
        if (r.enforces_ingress if direction is Direction.INGRESS else r.enforces_egress)
    ]
    if not enforcing:
        return DirectionTrace(
            False, Verdict.ALLOW, [], [f"  no rule selects it for {name}: all {name} allowed"]
        )
    lines = [f"  {name} enforced by: {', '.join(enforcing)}"]
    allows: list[str] = []
    denies: list[str] = []
    requires = [s for r in rules for s in r.requirements(direction)]
    unmet = [s for s in requires if not s.matches(peer)]
    if unmet:
        lines.append(f"  the peer does not meet the requirement(s) {', '.join(map(str, unmet))}")
    for rule in rules:
        for clause in rule.clauses:
            if clause.direction is not direction:
                continue
            matched = [
                s
                for s in clause.selectors
                if s.matches(peer) and not (unmet and s in clause.endpoint_selectors)
            ]
            if not matched:
                continue
            if not any(port_matches(p, dport, proto) for p in clause.ports):
                continue
            what = "denies" if clause.verdict is Verdict.DENY else "allows"
            sel = "any peer" if matched[0] is WILDCARD else str(matched[0])
            lines.append(f"  {rule.key} {clause.where} {what} {sel}")
            (denies if clause.verdict is Verdict.DENY else allows).append(rule.key)
    if direction is Direction.INGRESS and allow_localhost and peer.id == HOST and not denies:
        lines.append("  ingress from the local host is always allowed (allow-localhost)")
        allows.append(ALLOW_LOCALHOST)
    if denies:
        lines.append(f"  {name} DENIED: deny beats allow")
        return DirectionTrace(True, Verdict.DENY, sorted(set(denies)), lines)
    if allows:
        lines.append(f"  {name} ALLOWED")
        return DirectionTrace(True, Verdict.ALLOW, sorted(set(allows)), lines)
    lines.append(f"  {name} DENIED: no rule allows it (default deny)")
    return DirectionTrace(True, Verdict.DENY, [], lines)
