"""Real traffic through the programs: two pods (netns) on veths whose host
sides live in a "node" netns; policy changes take effect without reload;
pinned maps and attachments survive a reload by a new process.

Everything runs in namespaces this test creates; nothing leaves them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from harness.bpf import new_pin_root
from pyroute2.netns import popns, pushns

from flagella.datapath.bpf import (
    Backend,
    Datapath,
    Direction,
    DropReason,
    Frontend,
    NodeConfig,
    PolicyEntry,
    Programs,
    Service,
    frontend_rev_nat_id,
    tc,
)
from flagella.datapath.bpf import layout as L

pytestmark = pytest.mark.privileged

PING = r"""
import os, socket, struct, sys, time
def csum(b):
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF
ident = os.getpid() & 0xFFFF
body = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"flagella-ping"
pkt = body[:2] + struct.pack("!H", csum(body)) + body[4:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(0.3)
deadline = time.monotonic() + float(sys.argv[2])
s.sendto(pkt, (sys.argv[1], 0))
while time.monotonic() < deadline:
    try:
        data, addr = s.recvfrom(2048)
    except socket.timeout:
        continue
    ihl = (data[0] & 0xF) * 4
    if addr[0] == sys.argv[1] and data[ihl] == 0 and struct.unpack("!H", data[ihl + 4:ihl + 6])[0] == ident:
        sys.exit(0)
sys.exit(1)
"""

SERVER = r"""
# TCP and UDP echo on one port; answers "<peer address> <DATA>".
import selectors, socket, sys, time
port = int(sys.argv[1])
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("0.0.0.0", port))
t.listen(16)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("0.0.0.0", port))
sel = selectors.DefaultSelector()
sel.register(t, selectors.EVENT_READ)
sel.register(u, selectors.EVENT_READ)
print("ready", flush=True)
end = time.monotonic() + 240
while time.monotonic() < end:
    for key, _ in sel.select(1):
        if key.fileobj is u:
            data, peer = u.recvfrom(100)
            u.sendto(peer[0].encode() + b" " + data.upper(), peer)
            continue
        c, peer = t.accept()
        c.settimeout(2)
        try:
            c.sendall(peer[0].encode() + b" " + c.recv(100).upper())
        except OSError:
            pass
        c.close()
"""

CLIENT = r"""
# Prints "<server's view of us> <DATA> <our peer address>"; exit 1 on failure.
import socket, sys
host, port, proto = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    if proto == "tcp":
        c = socket.create_connection((host, port), timeout=1.5)
        c.sendall(b"hello")
        data, peer = c.recv(100), c.getpeername()
    else:
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c.settimeout(1.5)
        c.sendto(b"hello", (host, port))
        data, peer = c.recvfrom(100)
except OSError:
    sys.exit(1)
print(data.decode(), peer[0])
"""

RELOAD = r"""
import json, sys
from pyroute2.netns import pushns, popns
from flagella.datapath.bpf import Datapath
dp = Datapath.load(sys.argv[1])
state = {
    "created": dp.created,
    "revision_b": dp.endpoints.realized_revision(int(sys.argv[3])),
    "policy_b": dp.policy.entry_count(int(sys.argv[3])),
}
pushns(sys.argv[2])
try:
    for ifindex in sys.argv[4:]:
        dp.attach(int(ifindex))
    state["attached"] = [dp.attachment(int(i)).current for i in sys.argv[4:]]
finally:
    popns()
state["prog_ids"] = dp.prog_ids()
print(json.dumps(state))
"""


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def in_ns(ns: str, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def link(ns: str, name: str) -> dict[str, object]:
    data: list[dict[str, object]] = json.loads(sh("ip", "-n", ns, "-j", "link", "show", name))
    return data[0]


@dataclass
class Pods:
    node: str
    a: str
    b: str
    out: str  # a host outside the cluster, behind the node's uplink
    host_a: str
    host_b: str
    uplink: str
    ip_a: str = "10.222.0.1"
    ip_b: str = "10.222.0.2"
    ip_node: str = "192.168.77.1"
    ip_out: str = "192.168.77.2"

    def ifindex(self, host: str) -> int:
        return int(link(self.node, host)["ifindex"])  # type: ignore[call-overload]

    def mac(self, ns: str, name: str) -> str:
        return str(link(ns, name)["address"])


@pytest.fixture
def pods(require_root: None) -> Iterator[Pods]:
    tag = uuid.uuid4().hex[:6]
    p = Pods(
        f"flb-{tag}-node", f"flb-{tag}-a", f"flb-{tag}-b", f"flb-{tag}-out",
        f"flb{tag}a", f"flb{tag}b", f"flb{tag}up",
    )  # fmt: skip
    created: list[str] = []
    try:
        for ns in (p.node, p.a, p.b, p.out):
            sh("ip", "netns", "add", ns)
            created.append(ns)
        for pod, host, ip in ((p.a, p.host_a, p.ip_a), (p.b, p.host_b, p.ip_b)):
            sh("ip", "-n", p.node, "link", "add", host, "type", "veth", "peer", "name", "eth0",
               "netns", pod)  # fmt: skip
            sh("ip", "-n", p.node, "link", "set", host, "up")
            sh("ip", "-n", pod, "link", "set", "lo", "up")
            sh("ip", "-n", pod, "link", "set", "eth0", "up")
            sh("ip", "-n", pod, "addr", "add", f"{ip}/32", "dev", "eth0")
            sh("ip", "-n", pod, "route", "add", "169.254.1.1", "dev", "eth0", "scope", "link")
            sh("ip", "-n", pod, "route", "add", "default", "via", "169.254.1.1", "dev", "eth0")
            sh("ip", "-n", pod, "neigh", "add", "169.254.1.1", "lladdr", p.mac(p.node, host),
               "dev", "eth0", "nud", "permanent")  # fmt: skip
        sh("ip", "-n", p.node, "link", "add", p.uplink, "type", "veth", "peer", "name", "eth0",
           "netns", p.out)  # fmt: skip
        sh("ip", "-n", p.node, "addr", "add", f"{p.ip_node}/24", "dev", p.uplink)
        sh("ip", "-n", p.node, "link", "set", p.uplink, "up")
        sh("ip", "-n", p.out, "addr", "add", f"{p.ip_out}/24", "dev", "eth0")
        sh("ip", "-n", p.out, "link", "set", "eth0", "up")
        sh("ip", "-n", p.out, "link", "set", "lo", "up")
        yield p
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def ping(p: Pods, src_ns: str, dst: str) -> bool:
    return in_ns(src_ns, sys.executable, "-c", PING, dst, "1.0").returncode == 0


def talk(src_ns: str, dst: str, port: int, proto: str = "tcp") -> list[str] | None:
    """[server's view of the client, echoed data, client's view of the
    server], or None when no answer came."""
    out = in_ns(src_ns, sys.executable, "-c", CLIENT, dst, str(port), proto)
    return out.stdout.split() if out.returncode == 0 else None


def tcp(p: Pods, src_ns: str, dst: str, port: int) -> bool:
    reply = talk(src_ns, dst, port)
    return reply is not None and reply[1] == "HELLO"


def test_traffic_between_pods_policy_changes_and_reload(pods: Pods, bpf_programs: Programs) -> None:
    p = pods
    root = new_pin_root()
    server = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{p.b}", sys.executable, "-c", SERVER, "8080"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    dp = None
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        # Without programs there is no path between the pods at all.
        assert not ping(p, p.a, p.ip_b)

        dp = Datapath.load(root, programs=bpf_programs)
        ifa, ifb = p.ifindex(p.host_a), p.ifindex(p.host_b)
        ep_a, ep_b, id_a, id_b = 101, 102, 5001, 5002
        dp.endpoints.upsert(ep_a, [p.ip_a], ifindex=ifa, identity=id_a,
                            mac=p.mac(p.a, "eth0"), node_mac=p.mac(p.node, p.host_a))  # fmt: skip
        dp.endpoints.upsert(ep_b, [p.ip_b], ifindex=ifb, identity=id_b,
                            mac=p.mac(p.b, "eth0"), node_mac=p.mac(p.node, p.host_b))  # fmt: skip
        pushns(p.node)
        try:
            dp.attach(ifa)
            dp.attach(ifb)
            assert dp.attachment(ifa).current
            assert dp.attachment(ifb).current
        finally:
            popns()

        # Attached, but no policy yet: dropped, never allowed by default.
        assert not ping(p, p.a, p.ip_b)
        assert dp.metrics.drops(DropReason.POLICY_NOT_READY) >= 1

        for ep in (ep_a, ep_b):
            dp.policy.apply(ep, [], 1, ingress_enforced=False, egress_enforced=False)
        assert ping(p, p.a, p.ip_b)
        assert tcp(p, p.a, p.ip_b, 8080)

        # B now accepts nothing: denied without any reload.
        dp.policy.apply(ep_b, [], 2, ingress_enforced=True, egress_enforced=False)
        assert not ping(p, p.a, p.ip_b)
        assert not tcp(p, p.a, p.ip_b, 8080)
        assert dp.metrics.drops(DropReason.POLICY_L3, Direction.INGRESS) >= 2

        # B accepts A on TCP 8080 only.
        dp.policy.apply(ep_b, [PolicyEntry(id_a, Direction.INGRESS, protocol=6, port=8080)], 3,
                        egress_enforced=False)  # fmt: skip
        assert tcp(p, p.a, p.ip_b, 8080)
        assert not ping(p, p.a, p.ip_b)
        assert dp.metrics.drops(DropReason.POLICY_L4, Direction.INGRESS) >= 1
        old_ids = dp.prog_ids()
        dp.close()
        dp = None

        # A new process (compiles, reuses the pinned maps, reattaches).
        out = in_ns(
            p.node, sys.executable, "-c", RELOAD, root, p.node, str(ep_b), str(ifa), str(ifb),
            timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        state = json.loads(out.stdout)
        assert state["created"] is False
        assert state["revision_b"] == 3
        assert state["policy_b"] == 2
        assert state["attached"] == [True, True]
        assert state["prog_ids"]["from_container"] != old_ids["from_container"]
        # That process is gone; its programs stay attached and enforce the
        # same policy from the same maps.
        assert tcp(p, p.a, p.ip_b, 8080)
        assert not ping(p, p.a, p.ip_b)

        dp = Datapath.load(root, programs=bpf_programs)
        pushns(p.node)
        try:
            att = dp.attachment(ifa)
            assert att.ingress is not None
            assert att.ingress.prog_id == state["prog_ids"]["from_container"]
            assert not att.current  # this instance loaded its own copies
        finally:
            popns()
        dp.policy.apply(ep_b, [PolicyEntry(id_a, Direction.INGRESS)], 4, egress_enforced=False)
        assert ping(p, p.a, p.ip_b)
        assert ping(p, p.b, p.ip_a)

        # Replacing kept one filter per hook; detach removes them.
        pushns(p.node)
        try:
            assert len(tc.filters(ifa, tc.INGRESS)) == 1
            assert len(tc.filters(ifa, tc.EGRESS)) == 1
            dp.attach(ifa)  # atomic replace by this instance
            assert dp.attachment(ifa).current
            assert len(tc.filters(ifa, tc.INGRESS)) == 1
            assert dp.detach(ifa)
            assert dp.attachment(ifa).ingress is None
            assert dp.attachment(ifa).egress is None
            assert not dp.detach(ifa)
        finally:
            popns()
        assert not ping(p, p.a, p.ip_b)
    finally:
        server.kill()
        server.wait()
        if dp is not None:
            dp.close()
        shutil.rmtree(root, ignore_errors=True)


def start_server(ns: str, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", SERVER, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        raise AssertionError(f"server in {ns} did not start")
    return proc


def test_service_and_masquerade_over_veth(pods: Pods, bpf_programs: Programs) -> None:
    p = pods
    root = new_pin_root()
    servers: list[subprocess.Popen[str]] = []
    dp = None
    try:
        servers.append(start_server(p.b, 8080))
        servers.append(start_server(p.out, 9090))
        # The node routes pod traffic to the outside; only in its own netns.
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                    "net.ipv4.conf.default.rp_filter=0"):  # fmt: skip
            in_ns(p.node, "sysctl", "-qw", key).check_returncode()
        for ip, host in ((p.ip_a, p.host_a), (p.ip_b, p.host_b)):
            sh("ip", "-n", p.node, "route", "add", ip, "dev", host)

        dp = Datapath.load(root, programs=bpf_programs)
        dp.config.write(NodeConfig(node_ip4=p.ip_node, masquerade4=True))
        ifa, ifb = p.ifindex(p.host_a), p.ifindex(p.host_b)
        ep_a, ep_b, id_a, id_b = 201, 202, 6001, 6002
        dp.endpoints.upsert(ep_a, [p.ip_a], ifindex=ifa, identity=id_a,
                            mac=p.mac(p.a, "eth0"), node_mac=p.mac(p.node, p.host_a))  # fmt: skip
        dp.endpoints.upsert(ep_b, [p.ip_b], ifindex=ifb, identity=id_b,
                            mac=p.mac(p.b, "eth0"), node_mac=p.mac(p.node, p.host_b))  # fmt: skip
        dp.policy.apply(ep_a, [], 1, ingress_enforced=False, egress_enforced=False)
        dp.policy.apply(
            ep_b,
            [PolicyEntry(id_a, Direction.INGRESS, port=8080)],  # TCP, UDP, SCTP 8080
            1,
            egress_enforced=False,
        )
        vip = "10.96.0.10"
        dp.upsert_service(
            Service(
                1,
                (
                    Frontend(vip, 80, 6, frontend_rev_nat_id(1, 0)),
                    Frontend(vip, 80, 17, frontend_rev_nat_id(1, 1)),
                ),
                (Backend(1, p.ip_b, 8080),),
            )
        )
        pushns(p.node)
        try:
            dp.attach(ifa)
            dp.attach(ifb)
            dp.attach_netdev(p.ifindex(p.uplink))
        finally:
            popns()

        # ClusterIP: the backend sees the client, the client sees the VIP.
        for proto in ("tcp", "udp", "tcp", "tcp", "udp"):
            assert talk(p.a, vip, 80, proto) == [p.ip_a, "HELLO", vip], proto
        # Directly to the backend's port is the same policy.
        assert talk(p.a, p.ip_b, 8080) == [p.ip_a, "HELLO", p.ip_b]

        # The outside knows no route to the pods: only masquerade works.
        for proto in ("tcp", "udp"):
            assert talk(p.a, p.ip_out, 9090, proto) == [p.ip_node, "HELLO", p.ip_out], proto
        outs = [e for e in dp.nat.entries() if e[1] == L.NAT_OUT]
        assert {(t.src, t.dst, ip) for t, _, ip, _ in outs} == {(p.ip_a, p.ip_out, p.ip_node)}
        dp.config.write(NodeConfig(node_ip4=p.ip_node, masquerade4=False))
        assert talk(p.a, p.ip_out, 9090) is None
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        if dp is not None:
            dp.close()
        shutil.rmtree(root, ignore_errors=True)
