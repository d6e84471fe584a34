"""End to end: DNS-aware egress (toFQDNs) through the node's DNS proxy, on a
real pod made by `flagella-cni ADD`, its DNS redirected by the BPF to the
proxy in the datapath, which forwards to a DNS server of the test's own (in
the node's outside netns) and teaches the answers to the policy service
before releasing them. One set-up, the issue's acceptance in order."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from harness.cluster import OUTSIDE_IP, Cluster, Node, cli
from harness.cnipods import CniPod, cni_pod
from harness.dns import serve_dns
from harness.netns import Netns, wait_until

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

DNS = OUTSIDE_IP.format(n=101)  # the first node's outside host serves DNS
NET = DNS.rsplit(".", 1)[0]  # its /24: the addresses the names resolve to
API, OTHER, BARE, UNASSIGNED = f"{NET}.10", f"{NET}.11", f"{NET}.12", f"{NET}.99"
REPEATS = 100
PORT = 443


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


def policy(fqdn: str, dns: str = "") -> str:
    rules = f"\n      rules: {{dns: [{dns}]}}" if dns else ""
    return f"""
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: web-egress, namespace: shop}}
spec:
  endpointSelector: {{matchLabels: {{app: web}}}}
  egress:
  - toCIDR: [{NET}.0/24]
    toPorts:
    - ports: [{{port: "53", protocol: UDP}}, {{port: "53", protocol: TCP}}]{rules}
  - toFQDNs: [{{{fqdn}}}]
    toPorts: [{{ports: [{{port: "{PORT}", protocol: TCP}}]}}]
"""


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    node = cluster.add_node(
        "n1", extra=["--dns-proxy-upstream-timeout", "1", "--tofqdns-gc-interval-seconds", "1"]
    )
    batch = "".join(
        f"addr add {NET}.{i}/24 dev eth0\n" for i in (10, 11, 12, 13, *range(101, 101 + REPEATS))
    )
    subprocess.run(
        ["ip", "-n", node.outside.name, "-batch", "-"], input=batch, text=True, check=True
    )
    return node


def in_pod(pod: Netns, *steps: tuple[str, str, str]) -> list[dict[str, object]]:
    out = pod.run(sys.executable, "-c", CLIENT, DNS, str(PORT), json.dumps(steps), timeout=300)
    results: list[dict[str, object]] = json.loads(out.stdout)
    return results


def flows(cluster: Cluster, node: Node, verdict: int) -> list[datapath_pb2.Flow]:
    request = datapath_pb2.ObserveFlowsRequest(verdicts=[verdict], last=500, follow=False)
    return list(cluster.datapath(node).ObserveFlows(request, timeout=10))


def test_dns_aware_egress_through_the_node_proxy(cluster: Cluster, node: Node) -> None:
    serve_dns(node.outside, NET)
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
    # Dropped by policy, with the reason (its /24 is allowed on port 53 only).
    dropped = flows(cluster, node, datapath_pb2.FLOW_VERDICT_DROPPED)
    reasons = {f.drop_reason for f in dropped if f.dst_ip in (OTHER, BARE)}
    assert reasons == {datapath_pb2.DROP_REASON_POLICY_L4}, dropped

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

    # DNS rules: a name outside them gets REFUSED, with an L7 flow of its
    # own (DROPPED); the names inside resolve and connect as before.
    cluster.policy().PutRules(
        policy_pb2.PutRulesRequest(
            document=policy('matchPattern: "*.example.test"', '{matchPattern: "r*.example.test"}')
        ),
        timeout=10,
    )
    assert wait_until(
        lambda: in_pod(pod, ("resolve", "api.example.test", "udp"))[0].get("rcode") == "REFUSED"
    )
    (allowed,) = in_pod(pod, ("resolve_connect", "r7.example.test", "tcp"))
    assert allowed["connected"] is True
    refused = [
        f
        for f in flows(cluster, node, datapath_pb2.FLOW_VERDICT_DROPPED)
        if f.type == datapath_pb2.FLOW_TYPE_L7
    ]
    assert refused
    assert {(f.dns.query, f.dns.rcode, f.src_ip) for f in refused} == {
        ("api.example.test", 5, web.ip4)
    }
    answered = [
        f
        for f in flows(cluster, node, datapath_pb2.FLOW_VERDICT_FORWARDED)
        if f.type == datapath_pb2.FLOW_TYPE_L7 and f.dns.query == "r7.example.test"
    ]
    assert [list(f.dns.ips) for f in answered][-1:] == [[f"{NET}.107"]]
    cluster.policy().PutRules(
        policy_pb2.PutRulesRequest(document=policy('matchPattern: "*.example.test"')), timeout=10
    )
    assert wait_until(
        lambda: in_pod(pod, ("resolve", "api.example.test", "udp"))[0].get("rcode") == "NOERROR"
    )

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

    # TTL: an expired entry stays while a connection uses its address, and
    # goes (with the address's identity: no new connection) once none does.
    short = f"{NET}.13"
    assert in_pod(pod, ("resolve_connect", "short.example.test", "udp"))[0]["connected"] is True
    hold = pod.stream(short, PORT, 0.05, hello=True)
    assert hold.stdout is not None
    assert hold.stdout.readline().strip() == "outside"
    assert wait_until(
        lambda: any(
            "expired, kept" in line and "short.example.test" in line
            for line in node.process.logs().splitlines()  # type: ignore[union-attr]
        )
    )
    assert "short.example.test" in cli(cluster, "fqdn", "cache", "list", "--node", "n1").stdout
    hold.kill()
    # A closed connection's conntrack entry lives 10 s more.
    assert wait_until(
        lambda: "short.example.test" not in cli(cluster, "fqdn", "cache", "list").stdout, 30
    )
    assert in_pod(pod, ("connect", short, ""))[0]["connected"] is False

    # Deleting the cache's entries: the policy follows (no new connection).
    gone = cli(cluster, "fqdn", "cache", "delete", "--node", "n1", "--match-pattern", "*")
    assert gone.returncode == 0, gone.stderr
    assert wait_until(lambda: in_pod(pod, ("connect", f"{NET}.103", ""))[0]["connected"] is False)
    listed = cli(cluster, "fqdn", "cache", "list", "--node", "n1")
    assert "example.test" not in listed.stdout
