"""A DNS server of the tests' own (dnspython) in a netns, for the DNS
proxy's tests and benchmark: UDP and TCP port 53, a few names under
example.test (short.example.test with a TTL of 1 s, the others 60 s) and a
wildcard zone r<N>.example.test -> NET.(100+N); anything else NXDOMAIN. NET is a /24's first three octets."""

from __future__ import annotations

import sys

from harness.netns import Netns

SERVER = r"""
import socket, struct, sys, threading
import dns.message, dns.rcode, dns.rrset
net = sys.argv[1]
names = {"api.example.test.": (f"{net}.10", 60), "other.example.test.": (f"{net}.11", 60),
         "example.test.": (f"{net}.12", 60), "short.example.test.": (f"{net}.13", 1)}
def address(name):
    if name in names:
        return names[name]
    first = name.split(".")[0]
    if name.endswith(".example.test.") and first[:1] == "r" and first[1:].isdigit():
        return f"{net}.{100 + int(first[1:])}", 60
def answer(wire):
    q = dns.message.from_wire(wire)
    r = dns.message.make_response(q)
    name = q.question[0].name.to_text().lower()
    found = address(name)
    if found is None:
        r.set_rcode(dns.rcode.NXDOMAIN)
    else:
        r.answer.append(dns.rrset.from_text(name, found[1], "IN", "A", found[0]))
    return r.to_wire()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("0.0.0.0", 53))
tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); tcp.bind(("0.0.0.0", 53)); tcp.listen(64)
def serve_tcp():
    while True:
        c, _ = tcp.accept()
        with c:
            n = struct.unpack("!H", c.recv(2))[0]
            data = b""
            while len(data) < n:
                data += c.recv(n - len(data))
            out = answer(data)
            c.sendall(struct.pack("!H", len(out)) + out)
threading.Thread(target=serve_tcp, daemon=True).start()
print("ready", flush=True)
while True:
    data, peer = udp.recvfrom(4096)
    udp.sendto(answer(data), peer)
"""


def serve_dns(ns: Netns, net: str) -> None:
    """The server in ns, answering with addresses of net; returns once it
    listens."""
    proc = ns.popen(sys.executable, "-c", SERVER, net)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"DNS server in {ns.name} did not start: {line}")
