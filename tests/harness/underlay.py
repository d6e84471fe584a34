"""A shared underlay for several nodes: a bridge in a netns of its own, each
node's uplink a veth into it, and an "outside" host on it (not a node: no
route to any pod CIDR). IPv4 and IPv6 on one segment; nothing leaves the
machine."""

from __future__ import annotations

from harness.netns import Netns, NetnsSet

SUBNET4 = "192.168.100.{n}"
SUBNET6 = "fd00:100::{n}"
OUTSIDE_HOST = 254


class Underlay:
    def __init__(self, nss: NetnsSet) -> None:
        self.bridge = nss.new("ul")
        self.bridge.ip("link", "add", "br0", "type", "bridge")
        self.bridge.ip("link", "set", "br0", "up")
        self.outside = nss.new("out")
        self.outside_ip4, self.outside_ip6 = self.plug(self.outside, OUTSIDE_HOST, "eth0")

    def plug(self, ns: Netns, n: int, ifname: str) -> tuple[str, str]:
        """Connects ns to the bridge as host n (its interface ifname);
        returns its IPv4 and IPv6 addresses."""
        port = f"p{n}"
        self.bridge.ip(
            "link", "add", port, "type", "veth", "peer", "name", ifname, "netns", ns.name
        )
        self.bridge.ip("link", "set", port, "master", "br0", "up")
        ip4, ip6 = SUBNET4.format(n=n), SUBNET6.format(n=n)
        ns.ip("addr", "add", f"{ip4}/24", "dev", ifname)
        ns.ip("-6", "addr", "add", f"{ip6}/64", "dev", ifname, "nodad")
        ns.ip("link", "set", ifname, "up")
        return ip4, ip6
