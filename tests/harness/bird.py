"""A BGP router for tests: Debian's BIRD 2 in a network namespace, started
by PID with its own configuration, log and control socket in the test's
temp folder, peered with the nodes' speakers; its routes go into the
namespace's kernel table (ECMP: one next hop per node advertising a
prefix). `birdc` reads its protocols and routes."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from harness.netns import Netns


@dataclass(frozen=True)
class BirdNeighbor:
    name: str  # BIRD's protocol name
    address: str
    asn: int


def config(
    router_id: str,
    asn: int,
    neighbors: list[BirdNeighbor],
    *,
    log: Path,
    hold_time: int = 3,
    keepalive: int = 1,
    password: str = "",
    announce: tuple[str, ...] = (),
) -> str:
    """BIRD's configuration: eBGP with each neighbour, importing all it is
    sent; announce: prefixes it sends the neighbours itself (static
    blackholes; nothing else is exported to them)."""
    v4 = [p for p in announce if ":" not in p]
    v6 = [p for p in announce if ":" in p]
    lines = [
        f'log "{log}" all;',
        f"router id {router_id};",
        "protocol device { scan time 1; }",
        # ECMP into the kernel: every node advertising a prefix is a next hop.
        "protocol kernel k4 { ipv4 { import none; export all; }; merge paths on; }",
        "protocol kernel k6 { ipv6 { import none; export all; }; merge paths on; }",
        "protocol static s4 { ipv4; " + "".join(f"route {p} blackhole; " for p in v4) + "}",
        "protocol static s6 { ipv6; " + "".join(f"route {p} blackhole; " for p in v6) + "}",
        "template bgp node {",
        f"  local as {asn};",
        f"  hold time {hold_time}; keepalive time {keepalive};",
        "  connect retry time 1; error wait time 1, 2;",
        *([f'  password "{password}";'] if password else []),
        "}",
    ]
    for n in neighbors:
        channel, static = ("ipv6", "s6") if ":" in n.address else ("ipv4", "s4")
        lines.append(
            f"protocol bgp {n.name} from node {{ neighbor {n.address} as {n.asn}; "
            f'{channel} {{ import all; export where proto = "{static}"; }}; }}'
        )
    return "\n".join(lines) + "\n"


class Bird:
    def __init__(self, ns: Netns, folder: Path) -> None:
        self.ns = ns
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.conf = folder / "bird.conf"
        self.socket = folder / "bird.ctl"
        self.log = folder / "bird.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, text: str) -> Bird:
        self.conf.write_text(text)
        self.proc = subprocess.Popen(
            ["nsenter", f"--net={self.ns.path}", "bird", "-f", "-c", str(self.conf),
             "-s", str(self.socket)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bird did not start: {self.log_text()}")
            time.sleep(0.05)
        return self

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def reconfigure(self, text: str) -> None:
        self.conf.write_text(text)
        self.birdc("configure")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def birdc(self, *args: str, check: bool = True) -> str:
        """birdc's output (it exits 1 when, say, a route asked for is none)."""
        out = subprocess.run(
            ["birdc", "-s", str(self.socket), *args],
            capture_output=True, text=True, timeout=10, check=check,
        )  # fmt: skip
        return out.stdout

    def protocols(self) -> dict[str, tuple[str, str]]:
        """BGP protocol name -> (state, info), e.g. ("up", "Established")."""
        out: dict[str, tuple[str, str]] = {}
        for line in self.birdc("show", "protocols").splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[1] == "BGP":
                out[parts[0]] = (parts[3], " ".join(parts[5:]))
        return out

    def established(self) -> set[str]:
        return {n for n, (state, info) in self.protocols().items() if "Established" in info}

    def routes(self, table: str = "") -> dict[str, set[str]]:
        """prefix -> the next hops BIRD holds a route over (best or not),
        from `birdc show route`; table: master4 or master6 (default both)."""
        args = ["show", "route"] + (["table", table] if table else ["table", "all"])
        out: dict[str, set[str]] = {}
        prefix = ""
        for line in self.birdc(*args).splitlines():
            if not line.strip() or line.startswith(("BIRD", "Table")):
                continue
            if not line[0].isspace():
                prefix = line.split()[0]
            m = re.search(r"\bvia (\S+)", line)
            if m and prefix:
                out.setdefault(prefix, set()).add(m.group(1))
        return out
