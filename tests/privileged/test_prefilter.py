"""The XDP prefilter through the datapath service: a node netns running the
datapath process with its uplink to an outside netns, which sends from a
listed and an unlisted address of each family. Real XDP, real kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import tls
from harness.cluster import Cluster, Node
from harness.metrics import check_documented
from harness.netns import Netns

from flagella.api.datapath.v1 import datapath_pb2 as pb

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

Code = grpc.StatusCode
PORT = 7777

# Sends n datagrams from src to dst:port, one at a time, each waiting up to
# timeout for its answer; prints how many were answered.
SEND = r"""
import socket, sys
src, dst, port, n, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
s = socket.socket(socket.AF_INET6 if ":" in dst else socket.AF_INET, socket.SOCK_DGRAM)
s.bind((src, 0))
s.settimeout(timeout)
answered = 0
for i in range(n):
    s.sendto(b"HELLO", (dst, port))
    try:
        s.recvfrom(4096)
        answered += 1
    except socket.timeout:
        pass
print(answered)
"""


def send(ns: Netns, src: str, dst: str, n: int, timeout: float) -> int:
    out = ns.run(sys.executable, "-c", SEND, src, dst, str(PORT), str(n), str(timeout))
    return int(out.stdout.strip())


def udp_in(node: Node) -> int:
    """Datagrams the node's stack delivered (IPv4 and IPv6 UDP)."""
    snmp = node.netns.run("cat", "/proc/net/snmp").stdout.splitlines()
    names, values = (line.split() for line in snmp if line.startswith("Udp:"))
    total = int(values[names.index("InDatagrams")])
    for line in node.netns.run("cat", "/proc/net/snmp6").stdout.splitlines():
        key, value = line.split()
        if key == "Udp6InDatagrams":
            total += int(value)
    return total


def cli(node: Node, *args: str) -> Any:
    """`flagella -o json ...` against the node's datapath, as an operator."""
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "flagella"),
            "--tls-dir", str(tls.session().bundle(tls.OPERATOR)),
            "--datapath-address", node.address,
            "-o", "json", *args,
        ],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def expect(code: grpc.StatusCode, field: str, call: object) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    assert err.value.code() == code, err.value
    assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()


def entries(state: pb.Prefilter) -> dict[str, int]:
    return {e.cidr: e.dropped_packets for e in state.entries}


def test_prefilter_drops_listed_sources_in_xdp_and_survives_a_restart(cluster: Cluster) -> None:
    node = cluster.add_node("n1")
    out = node.outside
    n = node.index + 100
    listed4, other4 = f"192.168.{n}.200", f"192.168.{n}.254"
    listed6, other6, node6 = f"fd00:{n}::c8", f"fd00:{n}::fe", f"fd00:{n}::1"
    out.ip("addr", "add", f"{listed4}/24", "dev", "eth0")
    for addr in (listed6, other6):
        out.ip("addr", "add", f"{addr}/64", "dev", "eth0", "nodad")
    node.netns.ip("addr", "add", f"{node6}/64", "dev", "up0", "nodad")
    # A static neighbour: no solicitation from a listed source is needed
    # (the prefilter would drop it, and the counts below are exact).
    mac = str(node.netns.link("up0")["address"])
    out.ip("neigh", "replace", node6, "lladdr", mac, "dev", "eth0", "nud", "permanent")
    node.netns.serve("udp", PORT, "n1", v6=True)  # "::": both families
    stub = cluster.datapath(node)

    got = stub.GetPrefilter(pb.GetPrefilterRequest(), timeout=10)
    assert got.revision == 0
    assert not got.entries
    assert got.max_entries == 1024
    [dev] = got.devices
    assert (dev.name, dev.attached) == ("up0", True)
    assert dev.mode in ("native", "generic")
    assert "xdp" in node.netns.link("up0")
    assert send(out, listed4, node.ip, 1, 2.0) == 1

    # Refused, naming the field; nothing changes.
    def patch(cidrs: list[str], revision: int) -> pb.Prefilter:
        return stub.PatchPrefilter(pb.PatchPrefilterRequest(cidrs=cidrs, revision=revision))

    expect(Code.INVALID_ARGUMENT, "cidrs[1]", lambda: patch(["10.0.0.0/8", "bogus"], 0))
    expect(Code.INVALID_ARGUMENT, "cidrs[0]", lambda: patch(["10.0.0.1/8"], 0))
    expect(Code.INVALID_ARGUMENT, "cidrs[0]", lambda: patch(["10.0.0.1"], 0))
    expect(Code.INVALID_ARGUMENT, "cidrs", lambda: patch([], 0))
    many = [f"10.{i // 256}.{i % 256}.0/24" for i in range(1025)]
    expect(Code.INVALID_ARGUMENT, "cidrs[1024]", lambda: patch(many, 0))
    expect(Code.FAILED_PRECONDITION, "revision", lambda: patch(["10.0.0.0/8"], 7))
    assert stub.GetPrefilter(pb.GetPrefilterRequest()).revision == 0

    got = patch([f"{listed4}/32", f"{listed6}/128", "198.51.100.0/24"], 0)
    assert got.revision == 1
    assert entries(got) == {f"{listed4}/32": 0, "198.51.100.0/24": 0, f"{listed6}/128": 0}

    # Listed sources: dropped in XDP, counted, never seen by the stack.
    before = udp_in(node)
    assert send(out, listed4, node.ip, 3, 0.3) == 0
    assert send(out, listed6, node6, 2, 0.3) == 0
    assert udp_in(node) == before
    got = stub.GetPrefilter(pb.GetPrefilterRequest())
    assert entries(got)[f"{listed4}/32"] == 3
    assert entries(got)[f"{listed6}/128"] == 2
    assert got.entries[0].dropped_bytes >= 3 * 42
    # Others pass.
    assert send(out, other4, node.ip, 1, 2.0) == 1
    assert send(out, other6, node6, 1, 2.0) == 1
    assert udp_in(node) == before + 2

    # The counters, summed by family, as metrics (scraped inside the node).
    scrape = node.netns.run(
        sys.executable,
        "-c",
        "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())",
        f"http://{node.process.metrics_listen}/metrics",  # type: ignore[union-attr]
    ).stdout
    check_documented(scrape)
    assert 'flagella_prefilter_drop_count_total{family="ipv4"} 3.0' in scrape
    assert 'flagella_prefilter_drop_count_total{family="ipv6"} 2.0' in scrape
    assert 'flagella_prefilter_cidrs{family="ipv4"} 2.0' in scrape

    # Delete: a stale revision and an unlisted CIDR are refused; then it passes again.
    def delete(cidrs: list[str], revision: int) -> pb.Prefilter:
        return stub.DeletePrefilter(pb.DeletePrefilterRequest(cidrs=cidrs, revision=revision))

    expect(Code.FAILED_PRECONDITION, "revision", lambda: delete([f"{listed4}/32"], 0))
    expect(Code.NOT_FOUND, "cidrs[1]", lambda: delete([f"{listed4}/32", "10.9.0.0/16"], 1))
    # Through the CLI (which reads the revision first).
    got_json = cli(node, "prefilter", "delete", f"{listed4}/32")
    assert got_json["revision"] == "2"
    got = stub.GetPrefilter(pb.GetPrefilterRequest())
    assert got.revision == 2
    assert f"{listed4}/32" not in entries(got)
    assert send(out, listed4, node.ip, 1, 2.0) == 1

    # A restart: the list (state folder), its counters (pinned) and the
    # program on the device are back before SERVING.
    assert node.process is not None
    node.process.stop()
    cluster.start_datapath(node)
    got = stub.GetPrefilter(pb.GetPrefilterRequest(), timeout=10)
    assert got.revision == 2
    assert entries(got) == {"198.51.100.0/24": 0, f"{listed6}/128": 2}
    assert [(d.name, d.attached) for d in got.devices] == [("up0", True)]
    assert send(out, listed6, node6, 1, 0.3) == 0
    assert entries(stub.GetPrefilter(pb.GetPrefilterRequest()))[f"{listed6}/128"] == 3
    assert json.loads((node.state_dir / "prefilter.json").read_text())["revision"] == 2
    listed = cli(node, "prefilter", "list")
    assert [e["cidr"] for e in listed["entries"]] == ["198.51.100.0/24", f"{listed6}/128"]

    # Restarted with no prefilter device: the program comes off the uplink
    # (it would go on dropping), the list stays.
    node.process.stop()
    node.args = [*node.args, "--prefilter-devices", "none"]
    cluster.start_datapath(node)
    got = stub.GetPrefilter(pb.GetPrefilterRequest(), timeout=10)
    assert got.revision == 2
    assert not got.devices
    assert "xdp" not in node.netns.link("up0")
    assert send(out, listed6, node6, 1, 2.0) == 1
