"""Unit-test helper: a PolicyState fed with etcd-like key-values (no etcd),
and a reference lookup of policy-map entries as a datapath would do it."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.policy import keys
from flagella.policy.identities import HOST, WORLD
from flagella.policy.labels import format_labels, parse_labels
from flagella.policy.resolve import PolicyContent, PolicyEntry
from flagella.policy.rules import (
    CIDRGroup,
    Direction,
    Protocol,
    Rule,
    Verdict,
    cidr_group_to_json,
    parse_document,
    rule_to_json,
)
from flagella.policy.state import Change, PolicyState


@dataclass(frozen=True)
class FakeKV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


class World:
    """Identities and rules, as etcd would hold them, in a PolicyState."""

    def __init__(self, *, budget: int = 16384, allow_localhost: bool = True) -> None:
        self.state = PolicyState(budget=budget, allow_localhost=allow_localhost)
        self.rev = 1
        self.names: dict[str, int] = {"host": HOST, "world": WORLD}
        self._created: dict[str, int] = {}
        self._next = 256
        self.last_change = Change()

    def _put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.rev += 1
        created = self._created.setdefault(key, self.rev)
        self.state.put(FakeKV(key, value, self.rev, created, lease))

    def _delete(self, key: str) -> None:
        self.rev += 1
        self._created.pop(key, None)
        self.state.delete(key, self.rev)

    def commit(self) -> Change:
        self.last_change = self.state.commit(self.rev)
        return self.last_change

    def identity(self, name: str, *labels: str, ident: int | None = None) -> int:
        ls = parse_labels(labels)
        if ident is None:
            ident = self._next
            self._next += 1
        self._put(keys.id_key(ident), keys.dumps({"labels": [str(lb) for lb in ls]}))
        self._put(keys.labels_key(format_labels(ls)), keys.dumps({"id": ident}))
        self.names[name] = ident
        self.commit()
        return ident

    def pod(self, name: str, namespace: str, **labels: str) -> int:
        texts = [f"k8s:{k}={v}" for k, v in labels.items()]
        return self.identity(name, f"k8s:io.kubernetes.pod.namespace={namespace}", *texts)

    def remove_identity(self, name: str) -> None:
        ident = self.names.pop(name)
        self._delete(keys.id_key(ident))
        self.commit()

    def reference(self, ident: int, node: str, refs: int = 1) -> None:
        labels = self._labels_string(ident)
        self._put(keys.ref_key(labels, node), keys.dumps({"id": ident, "refs": refs}), lease=7)
        self.commit()

    def _labels_string(self, ident: int) -> str:
        info = self.state.info(ident)
        assert info is not None
        return format_labels(info.labels)

    def rules(self, document: str) -> list[Rule]:
        rules = parse_document(document)
        for rule in rules:
            self._put(keys.rule_key(rule.key), rule_to_json(rule))
        self.commit()
        return rules

    def put_rule(self, rule: Rule) -> None:
        self._put(keys.rule_key(rule.key), rule_to_json(rule))
        self.commit()

    def delete_rule(self, name: str) -> None:
        self._delete(keys.rule_key(name))
        self.commit()

    def cidr_group(self, name: str, *cidrs: str) -> None:
        self._put(keys.cidr_group_key(name), _cidr_group_json(*cidrs))
        self.commit()

    def delete_cidr_group(self, name: str) -> None:
        self._delete(keys.cidr_group_key(name))
        self.commit()

    def fqdn(self, node: str, endpoint: str, name: str, *ips: str, ttl: int = 30) -> None:
        """The FQDN cache entry a node's DNS proxy writes (on a lease)."""
        key = keys.fqdn_key(node, endpoint, name)
        if not ips:
            self._delete(key)
        else:
            value = {"ips": list(ips), "ttl": ttl, "expires": 1e9 + ttl, "lookup": 1e9}
            self._put(key, keys.dumps(value), lease=7)
        self.commit()

    def cidr(self, prefix: str) -> int:
        """The CIDR identity the rules gave prefix."""
        entry = self.state.ipcache_entry(prefix)
        assert entry is not None, f"no CIDR identity for {prefix}"
        return entry.identity

    def content(self, ident: int) -> PolicyContent:
        content = self.state.resolver.content(ident)
        assert content is not None
        return content

    def entries(self, ident: int) -> set[tuple[int, int, int, str, str, str]]:
        """Entries as (peer, port, end_port, protocol, direction, verdict)."""
        return {
            (e.identity, e.port, e.end_port, e.protocol.name, e.direction.name, e.verdict.name)
            for e in self.content(ident).entries
        }

    def allowed(self, src: int, dst: int, port: int = 80, proto: Protocol = Protocol.TCP) -> bool:
        """Whether both the source's egress and the destination's ingress
        allow the traffic, checked with two lookups that must agree: the
        rule semantics (an allow matches, no deny matches) and the most
        specific entry (as a datapath looks it up)."""
        out = lookup(self.content(src), dst, port, proto, Direction.EGRESS)
        inn = lookup(self.content(dst), src, port, proto, Direction.INGRESS)
        return out and inn


def _matches(e: PolicyEntry, peer: int, port: int, proto: Protocol, direction: Direction) -> bool:
    if e.direction is not direction:
        return False
    if e.identity not in (0, peer):
        return False
    if e.protocol is not Protocol.ANY and e.protocol is not proto:
        return False
    if e.port == 0:
        return True
    end = e.end_port or e.port
    return e.port <= port <= end


def lookup(
    content: PolicyContent, peer: int, port: int, proto: Protocol, direction: Direction
) -> bool:
    matching = [e for e in content.entries if _matches(e, peer, port, proto, direction)]
    semantic = any(e.verdict is Verdict.ALLOW for e in matching) and not any(
        e.verdict is Verdict.DENY for e in matching
    )

    def specificity(e: PolicyEntry) -> tuple[int, int, int, int]:
        width = 65536 if e.port == 0 else (e.end_port or e.port) - e.port
        return (
            e.identity != 0,
            -width,
            e.protocol is not Protocol.ANY,
            e.verdict is Verdict.DENY,
        )

    datapath = bool(matching) and max(matching, key=specificity).verdict is Verdict.ALLOW

    # The same with the port dimension ranked above the identity one.
    def port_first(e: PolicyEntry) -> tuple[int, int, int, int]:
        s = specificity(e)
        return (s[1], s[2], s[0], s[3])

    datapath2 = bool(matching) and max(matching, key=port_first).verdict is Verdict.ALLOW
    assert semantic == datapath == datapath2, (
        f"entries disagree for peer {peer} {port}/{proto.name} {direction.name}: "
        f"semantic={semantic} specific-identity-first={datapath} specific-port-first={datapath2}\n"
        + "\n".join(map(str, matching))
    )
    return semantic


def _cidr_group_json(*cidrs: str) -> bytes:
    return cidr_group_to_json(CIDRGroup("", tuple(cidrs)))
