"""End to end: DNS-aware egress (toFQDNs) through the node's DNS proxy, on a
real pod made by `flagella-cni ADD`, its DNS redirected by the BPF to the
proxy in the datapath, which forwards to a DNS server of the test's own (in
the node's outside netns) and teaches the answers to the policy service
before releasing them. One set-up, the issue's acceptance in order."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import tls
from harness.cluster import OUTSIDE_IP, Cluster, Node
from harness.cnipods import CniPod, cni_pod
from harness.netns import Netns, wait_until

from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

CLI = shutil.which("flagella", path=str(Path(sys.executable).parent)) or "flagella"
DNS = OUTSIDE_IP.format(n=101)  # the first node's outside host serves DNS
NET = DNS.rsplit(".", 1)[0]  # its /24: the addresses the names resolve to
API, OTHER, BARE, UNASSIGNED = f"{NET}.10", f"{NET}.11", f"{NET}.12", f"{NET}.99"
REPEATS = 100
PORT = 443

# A DNS server (dnspython) on UDP and TCP 53: a few names, a wildcard zone
# r<N>.example.test -> NET.(100+N); anything else NXDOMAIN.
SERVER = r"""
import socket, struct, sys, threading
import dns.message, dns.rcode, dns.rrset
net = sys.argv[1]
names = {"api.example.test.": f"{net}.10", "other.example.test.": f"{net}.11",
         "example.test.": f"{net}.12"}
def address(name):
    if name in names:
        return names[name]
    first = name.split(".")[0]
    if name.endswith(".example.test.") and first[:1] == "r" and first[1:].isdigit():
        return f"{net}.{100 + int(first[1:])}"
def answer(wire):
    q = dns.message.from_wire(wire)
    r = dns.message.make_response(q)
    name = q.question[0].name.to_text().lower()
    ip = address(name)
    if ip is None:
        r.set_rcode(dns.rcode.NXDOMAIN)
    else:
        r.answer.append(dns.rrset.from_text(name, 60, "IN", "A", ip))
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

# In the pod: each step is [what, name or address, option]; prints one JSON
# result per step. resolve: the A records (or the rcode), over UDP or TCP;
# connect: a TCP connection to PORT right after resolving (the no-race
# check); garbage: an unparsable datagram to the server.
CLIENT = r"""
import json, socket, sys, time
import dns.message, dns.query, dns.rcode, dns.rdatatype
server, port, steps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
def connect(ip):
    try:
        with socket.create_connection((ip, port), timeout=1.5) as s:
            s.settimeout(1.5)
            s.sendall(b"HELLO\n")
            return s.recv(100).decode().split()[0] == "outside"
    except OSError:
        return False
def resolve(name, how, where=server):
    q = dns.message.make_query(name, "A")
    started = time.monotonic()
    try:
        if how == "tcp":
            r = dns.query.tcp(q, where, timeout=5)
        else:
            r = dns.query.udp(q, where, timeout=5)
    except Exception as e:
        return {"error": type(e).__name__, "seconds": time.monotonic() - started}
    ips = [rd.address for rr in r.answer if rr.rdtype == dns.rdatatype.A for rd in rr]
    return {"rcode": dns.rcode.to_text(r.rcode()), "ips": ips,
            "seconds": round(time.monotonic() - started, 3)}
out = []
for what, arg, opt in steps:
    if what == "resolve":
        out.append(resolve(arg, opt))
    elif what == "resolve_at":
        out.append(resolve(opt, "udp", arg))
    elif what == "connect":
        out.append({"connected": connect(arg)})
    elif what == "resolve_connect":
        r = resolve(arg, opt)
        r["connected"] = bool(r.get("ips")) and connect(r["ips"][0])
        out.append(r)
    elif what == "garbage":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"\x00\x01 not a DNS message", (server, 53))
        out.append({})
print(json.dumps(out))
"""


def policy(fqdn: str) -> str:
    return f"""
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: web-egress, namespace: shop}}
spec:
  endpointSelector: {{matchLabels: {{app: web}}}}
  egress:
  - toCIDR: [{NET}.0/24]
    toPorts: [{{ports: [{{port: "53", protocol: UDP}}, {{port: "53", protocol: TCP}}]}}]
  - toFQDNs: [{{{fqdn}}}]
    toPorts: [{{ports: [{{port: "{PORT}", protocol: TCP}}]}}]
"""


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    node = cluster.add_node("n1", extra=["--dns-proxy-upstream-timeout", "1"])
    batch = "".join(
        f"addr add {NET}.{i}/24 dev eth0\n" for i in (10, 11, 12, *range(101, 101 + REPEATS))
    )
    subprocess.run(
        ["ip", "-n", node.outside.name, "-batch", "-"], input=batch, text=True, check=True
    )
    return node


def cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            CLI,
            "--tls-dir", str(tls.session().bundle(tls.OPERATOR)),
            "--policy-address", cluster.services["policy"].address,
            *args,
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def in_pod(pod: Netns, *steps: tuple[str, str, str]) -> list[dict[str, object]]:
    out = pod.run(sys.executable, "-c", CLIENT, DNS, str(PORT), json.dumps(steps), timeout=300)
    results: list[dict[str, object]] = json.loads(out.stdout)
    return results


def serve_dns(outside: Netns) -> None:
    proc = outside.popen(sys.executable, "-c", SERVER, NET)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"


def test_dns_aware_egress_through_the_node_proxy(cluster: Cluster, node: Node) -> None:
    serve_dns(node.outside)
    node.outside.serve("tcp", PORT, "outside")
    web: CniPod = cni_pod(cluster, node, "web", {"app": "web"})
    pod = web.ns
    # Without a toFQDNs rule nothing is redirected: the server answers as is.
    assert in_pod(pod, ("resolve_connect", "api.example.test", "udp"))[0]["connected"] is True

    # matchName on TCP 443: the name resolves (through the proxy) and its
    # address is reached; another address of the same server is not, nor a
    # name outside the rule.
    cluster.policy().PutRules(
        policy_pb2.PutRulesRequest(document=policy("matchName: api.example.test")), timeout=10
    )
    assert wait_until(lambda: in_pod(pod, ("connect", OTHER, ""))[0]["connected"] is False)
    api, other, by_tcp, direct = in_pod(
        pod,
        ("resolve_connect", "api.example.test", "udp"),
        ("resolve_connect", "other.example.test", "udp"),
        ("resolve", "api.example.test", "tcp"),
        ("connect", BARE, ""),
    )
    assert api == {"rcode": "NOERROR", "ips": [API], "connected": True, "seconds": api["seconds"]}
    assert other["ips"] == [OTHER]
    assert other["connected"] is False
    assert by_tcp["ips"] == [API]
    assert direct["connected"] is False

    # The cache shows what the proxy learned, per endpoint (CLI and gRPC).
    listed = cli(cluster, "fqdn", "cache", "list", "--node", "n1")
    assert listed.returncode == 0, listed.stderr
    assert "api.example.test" in listed.stdout
    assert API in listed.stdout
    entries = cluster.policy().ListFQDNCache(
        policy_pb2.ListFQDNCacheRequest(node="n1", match_pattern="api.example.test"), timeout=10
    )
    assert [(e.name, list(e.ips)) for e in entries.entries] == [("api.example.test", [API])]
    assert entries.entries[0].endpoint

    # matchPattern *.example.test: subdomains, not the bare domain; the
    # first connection right after each lookup of a new name never drops.
    cluster.policy().PutRules(
        policy_pb2.PutRulesRequest(document=policy('matchPattern: "*.example.test"')), timeout=10
    )
    steps = [("resolve_connect", f"r{i}.example.test", "udp") for i in range(1, REPEATS + 1)]
    results = in_pod(pod, *steps, ("resolve_connect", "example.test", "udp"))
    failed = [(i + 1, r) for i, r in enumerate(results[:REPEATS]) if not r.get("connected")]
    assert failed == []
    bare = results[REPEATS]
    assert bare["ips"] == [BARE]
    assert bare["connected"] is False

    # Errors: an unreachable server gives SERVFAIL promptly; an unparsable
    # datagram is dropped and the proxy keeps serving.
    unreachable, _, after = in_pod(
        pod,
        ("resolve_at", UNASSIGNED, "api.example.test"),
        ("garbage", "", ""),
        ("resolve", "api.example.test", "udp"),
    )
    assert unreachable["rcode"] == "SERVFAIL"
    assert float(str(unreachable["seconds"])) < 3
    assert after["ips"] == [API]
    assert node.process is not None
    assert wait_until(lambda: "unparsable" in node.process.logs())  # type: ignore[union-attr]

    # A connection to a learned address survives a restart of the datapath.
    hold = pod.stream(f"{NET}.101", PORT, 0.05, hello=True)
    assert hold.stdout is not None
    assert hold.stdout.readline().strip() == "outside"
    node.process.stop()
    cluster.start_datapath(node)
    assert in_pod(pod, ("resolve_connect", "r2.example.test", "udp"))[0]["connected"] is True
    time.sleep(0.5)
    hold.kill()
    lines = hold.stdout.read().split("\n")
    assert [line for line in lines if line.startswith("fail")] == [], lines
    assert sum(line.startswith("ok ") for line in lines) > 5, lines

    # Deleting the cache's entries: the policy follows (no new connection).
    gone = cli(cluster, "fqdn", "cache", "delete", "--node", "n1", "--match-pattern", "*")
    assert gone.returncode == 0, gone.stderr
    assert wait_until(lambda: in_pod(pod, ("connect", f"{NET}.103", ""))[0]["connected"] is False)
    listed = cli(cluster, "fqdn", "cache", "list", "--node", "n1")
    assert "example.test" not in listed.stdout
