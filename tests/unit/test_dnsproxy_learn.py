"""The DNS proxy's pure logic: what an answer teaches (names, addresses,
TTLs raised to the minimum), what the proxy already taught, and the
original destination read from a UDP query's ancillary data."""

from __future__ import annotations

import socket
import struct

import dns.message
import dns.rcode
import dns.rrset

from flagella.datapath.dnsproxy.expiry import Cached, due
from flagella.datapath.dnsproxy.learn import Learned, Taught, learned
from flagella.datapath.dnsproxy.sockets import (
    IP_ORIGDSTADDR,
    IPV6_ORIGDSTADDR,
    original_destination,
)


def answer(qname: str, *records: tuple[str, int, str, str]) -> dns.message.Message:
    query = dns.message.make_query(qname, "A")
    reply = dns.message.make_response(query)
    for name, ttl, kind, value in records:
        reply.answer.append(dns.rrset.from_text(name, ttl, "IN", kind, value))
    return reply


def test_an_answer_teaches_its_names_with_the_lowest_ttl_raised_to_the_minimum() -> None:
    reply = answer(
        "API.Example.test.",
        ("API.Example.test.", 300, "CNAME", "edge.cdn.test."),
        ("edge.cdn.test.", 30, "A", "192.0.2.2"),
        ("edge.cdn.test.", 30, "A", "192.0.2.1"),
        ("edge.cdn.test.", 20, "AAAA", "2001:db8::1"),
    )
    # Through the CNAME the question's name gets every address (a toFQDNs
    # rule names it), each owner its own; names lowercase, no final dot.
    assert learned(reply, 0) == [
        Learned("api.example.test", ("192.0.2.1", "192.0.2.2", "2001:db8::1"), 20),
        Learned("edge.cdn.test", ("192.0.2.1", "192.0.2.2", "2001:db8::1"), 20),
    ]
    assert [i.ttl for i in learned(reply, 60)] == [60, 60]


def test_an_answer_without_addresses_or_with_an_error_teaches_nothing() -> None:
    assert learned(answer("a.test.", ("a.test.", 60, "TXT", '"x"')), 0) == []
    failed = answer("a.test.", ("a.test.", 60, "A", "192.0.2.1"))
    failed.set_rcode(dns.rcode.SERVFAIL)
    assert learned(failed, 0) == []


def test_what_was_taught_needs_no_wait_until_forgotten() -> None:
    taught = Taught()
    items = [Learned("a.test", ("192.0.2.1",), 60)]
    assert taught.new(7, items) == items
    taught.add(7, items)
    assert taught.new(7, items) == []
    assert taught.new(8, items) == items  # per endpoint
    more = [Learned("a.test", ("192.0.2.1", "192.0.2.9"), 60)]
    assert taught.new(7, more) == more  # a new address
    taught.forget(7)
    assert taught.new(7, items) == items


def test_the_original_destination_of_a_query() -> None:
    v4 = struct.pack("!HH4s8x", socket.AF_INET, 53, socket.inet_aton("192.0.2.53"))
    assert original_destination([(socket.SOL_IP, IP_ORIGDSTADDR, v4)]) == ("192.0.2.53", 53)
    v6 = struct.pack(
        "!HHI16sI", socket.AF_INET6, 5353, 0, socket.inet_pton(socket.AF_INET6, "2001:db8::53"), 0
    )
    got = original_destination([(socket.IPPROTO_IPV6, IPV6_ORIGDSTADDR, v6)])
    assert got == ("2001:db8::53", 5353)
    assert original_destination([]) is None


def test_expired_entries_go_unless_a_connection_uses_them() -> None:
    fresh = Cached("7", "a.test", ("192.0.2.1",), expires=200.0)
    used = Cached("7", "b.test", ("192.0.2.2", "192.0.2.3"), expires=50.0)
    unused = Cached("8", "c.test", ("192.0.2.4",), expires=99.0)
    gone, kept = due([fresh, used, unused], now=100.0, in_use={"192.0.2.3", "192.0.2.1"})
    assert gone == [unused]
    assert kept == [used]


def test_a_known_answer_is_refreshed_once_half_its_ttl_has_passed() -> None:
    now = [100.0]
    taught = Taught(clock=lambda: now[0])
    items = [Learned("a.test", ("192.0.2.1",), 60)]
    assert taught.stale(7, items) == items
    taught.add(7, items)
    now[0] = 129.0
    assert taught.stale(7, items) == []
    now[0] = 130.0
    assert taught.stale(7, items) == items
