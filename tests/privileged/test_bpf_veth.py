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

from flagella.datapath.bpf import Datapath, Direction, DropReason, PolicyEntry, Programs, tc

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

TCP_SERVER = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(16)
print("ready", flush=True)
s.settimeout(1)
end = time.monotonic() + 240
while time.monotonic() < end:
    try:
        c, _ = s.accept()
    except socket.timeout:
        continue
    c.settimeout(2)
    try:
        c.sendall(c.recv(100).upper())
    except OSError:
        pass
    c.close()
"""

TCP_CLIENT = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)
    c.sendall(b"hello")
    sys.exit(0 if c.recv(100) == b"HELLO" else 2)
except OSError:
    sys.exit(1)
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
    host_a: str
    host_b: str
    ip_a: str = "10.222.0.1"
    ip_b: str = "10.222.0.2"

    def ifindex(self, host: str) -> int:
        return int(link(self.node, host)["ifindex"])  # type: ignore[call-overload]

    def mac(self, ns: str, name: str) -> str:
        return str(link(ns, name)["address"])


@pytest.fixture
def pods(require_root: None) -> Iterator[Pods]:
    tag = uuid.uuid4().hex[:6]
    p = Pods(f"flb-{tag}-node", f"flb-{tag}-a", f"flb-{tag}-b", f"flb{tag}a", f"flb{tag}b")
    created: list[str] = []
    try:
        for ns in (p.node, p.a, p.b):
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
        yield p
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def ping(p: Pods, src_ns: str, dst: str) -> bool:
    return in_ns(src_ns, sys.executable, "-c", PING, dst, "1.0").returncode == 0


def tcp(p: Pods, src_ns: str, dst: str, port: int) -> bool:
    return in_ns(src_ns, sys.executable, "-c", TCP_CLIENT, dst, str(port)).returncode == 0


def test_traffic_between_pods_policy_changes_and_reload(pods: Pods, bpf_programs: Programs) -> None:
    p = pods
    root = new_pin_root()
    server = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{p.b}", sys.executable, "-c", TCP_SERVER, "8080"],
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
