"""What an answer teaches (pure): the names and addresses of its A/AAAA
records, with their TTLs raised to the node's minimum, and which of them
this node already taught the policy service for an endpoint (those need
no wait before the answer goes out)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import dns.message
import dns.rcode
import dns.rdatatype

MAX_IPS = 1000  # per name, the policy service's limit (Cilium's per-hostname one)


@dataclass(frozen=True)
class Learned:
    name: str  # lowercase, no trailing dot
    ips: tuple[str, ...]
    ttl: int


def _name(n: dns.name.Name) -> str:
    return n.to_text(omit_final_dot=True).lower()


def learned(answer: dns.message.Message, min_ttl: int) -> list[Learned]:
    """Each owner name of the answer's A/AAAA records with its addresses,
    and the question's name with all of them (through a CNAME chain the
    question's name is what a toFQDNs rule names). TTL: the lowest of the
    records, at least min_ttl."""
    if answer.rcode() != dns.rcode.NOERROR:
        return []
    by_name: dict[str, tuple[list[str], int]] = {}
    every: list[str] = []
    low: int | None = None
    for rrset in answer.answer:
        if rrset.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
            continue
        ips, ttl = by_name.setdefault(_name(rrset.name), ([], rrset.ttl))
        by_name[_name(rrset.name)] = (ips, min(ttl, rrset.ttl))
        for rd in rrset:
            ip = rd.address
            if ip not in ips:
                ips.append(ip)
            if ip not in every:
                every.append(ip)
        low = rrset.ttl if low is None else min(low, rrset.ttl)
    if low is None:
        return []
    for q in answer.question:
        qname = _name(q.name)
        if qname not in by_name:
            by_name[qname] = (every, low)
    return [
        Learned(name, tuple(sorted(ips)[:MAX_IPS]), max(ttl, min_ttl))
        for name, (ips, ttl) in sorted(by_name.items())
    ]


class Taught:
    """Per endpoint, each name's addresses the policy service already has
    from this node and its policies were waited for: an answer within them
    needs no wait, and its entry is refreshed (its TTL, in the background)
    only once half of the TTL last taught has passed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # (endpoint, name) -> (addresses, when taught, TTL taught)
        self._known: dict[tuple[int, str], tuple[frozenset[str], float, int]] = {}

    def new(self, endpoint: int, items: list[Learned]) -> list[Learned]:
        """The items with addresses not taught yet."""
        empty: tuple[frozenset[str], float, int] = (frozenset(), 0.0, 0)
        return [i for i in items if not set(i.ips) <= self._known.get((endpoint, i.name), empty)[0]]

    def stale(self, endpoint: int, items: list[Learned]) -> list[Learned]:
        """The items last taught more than half their TTL ago."""
        now = self.clock()
        out = []
        for i in items:
            known = self._known.get((endpoint, i.name))
            if known is None or now - known[1] >= known[2] / 2:
                out.append(i)
        return out

    def add(self, endpoint: int, items: list[Learned]) -> None:
        now = self.clock()
        for i in items:
            key = (endpoint, i.name)
            ips = self._known[key][0] if key in self._known else frozenset()
            self._known[key] = (ips | frozenset(i.ips), now, i.ttl)

    def forget(self, endpoint: int, name: str | None = None) -> None:
        """An endpoint gone (name None), or an entry deleted."""
        for key in [k for k in self._known if k[0] == endpoint and name in (None, k[1])]:
            del self._known[key]
