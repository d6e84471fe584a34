"""Configuration of the datapath service."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from flagella.common.addresses import address_option
from flagella.common.config import ServiceConfig, option, parse_host_port, parse_ip
from flagella.common.errors import ConfigError
from flagella.common.pki import Identity
from flagella.datapath.bpf.layout import MapSizes
from flagella.datapath.bpf.mapevents import DEFAULT_MAP_EVENT_HISTORY

ROUTING_MODES = ("tunnel", "native")
VERDICT_EVENT_LEVELS = ("all", "enforced", "none")
# One endpoint may fill at most the whole policy map.
MAX_POLICY_BUDGET = MapSizes().policy
# Writes kept per map: the history stays a few MiB at most.
MAX_MAP_EVENT_HISTORY = 65536
# Flows kept: Hubble's largest buffer.
MAX_FLOW_BUFFER = 65535

# A Kubernetes label: an optional DNS prefix and a name; a value of up to 63.
_LABEL_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def parse_ifname(value: str) -> str:
    """A network interface name (IFNAMSIZ: at most 15 bytes), or none."""
    if not value or len(value.encode()) > 15 or any(c in value for c in "/: \t\n"):
        raise ValueError(f"{value!r} is not an interface name (1-15 bytes, no '/', ':' or space)")
    return value


def parse_node_label(value: str) -> str:
    """key=value, as a Kubernetes label."""
    key, sep, val = value.partition("=")
    if not sep:
        raise ValueError(f"{value!r} is not key=value")
    if not _LABEL_NAME.match(key):
        raise ValueError(f"{key!r} is not a valid label key")
    if not _LABEL_VALUE.match(val):
        raise ValueError(f"{val!r} is not a valid label value")
    return value


@dataclass(frozen=True)
class DatapathConfig(ServiceConfig):
    """flagella datapath service: the privileged eBPF datapath of one node."""

    USES_ETCD = False  # it never connects to etcd

    listen: str = option("127.0.0.1:50055", "gRPC address to serve on", parse=parse_host_port)
    metrics_listen: str = option(
        "127.0.0.1:9965",
        "serve Prometheus metrics (GET /metrics, HTTP) here; empty: off",
        parse=parse_host_port,
    )
    node_name: str = option(socket.gethostname(), "name of this node in the node registry")
    node_ip: tuple[str, ...] = option(
        (), "this node's internal IPs (one per family)", parse=parse_ip
    )
    advertise_address: str = option(
        "",
        "host:port other services reach this datapath at (default: --listen)",
        parse=parse_host_port,
    )
    ipam_address: str = address_option("", "ipam service (empty: do not register the node)")
    policy_address: str = address_option("", "policy service (empty: no policy stream)")
    lb_address: str = address_option("", "load-balancer service (empty: no services)")
    endpoint_address: str = address_option(
        "", "endpoint service, where flagella-cni's calls are relayed (empty: no CNI socket)"
    )
    cni_socket: str = option(
        "/run/flagella/cni.sock", "unix socket flagella-cni talks to (root only, mode 0600)"
    )
    bpf_root: str = option("/sys/fs/bpf/flagella", "bpffs folder the maps are pinned under")
    bpf_cache_dir: str = option(
        "/var/cache/flagella/bpf",
        "folder of compiled programs kept across restarts (private to root); empty: "
        "compile on every start",
    )
    state_dir: str = option(
        "/var/run/flagella/datapath", "folder of endpoint records (restored after a restart)"
    )
    uplink: str = option("", "the node's uplink interface (masquerade and NodePort run on it)")
    masquerade: bool = option(True, "SNAT pod traffic leaving the cluster to the node address")
    routing_mode: str = option(
        "tunnel",
        "how pods of other nodes are reached: tunnel (VXLAN, the source identity in the VNI) "
        "or native (each node's pod CIDRs routed via its node IP)",
    )
    verdict_events: str = option(
        "all",
        "which allowed new connections emit a policy-verdict flow event (drops always do): "
        "all (both ends of every one), enforced (only in a direction where the endpoint's "
        "policy is enforced, as Cilium's policy-verdict filter), none",
        choices=VERDICT_EVENT_LEVELS,
    )
    tunnel_port: int = option(8472, "UDP port of the VXLAN tunnel (tunnel mode)")
    health_port: int = option(4240, "TCP port other nodes probe this node's health on (0: none)")
    health_interval_seconds: float = option(5.0, "period of the probes of the other nodes")
    enable_ip_forward: bool = option(True, "turn on IP forwarding in the node's netns")
    proc_sys: str = option(
        "/proc/sys",
        "where sysctls are written (in a container: a rw mount of the host's /proc/sys)",
    )
    gc_interval_seconds: float = option(30.0, "conntrack and NAT garbage collection period")
    policy_map_max_entries: int = option(
        16384,
        "per-endpoint budget of policy-map keys (after port ranges are expanded); an "
        "endpoint whose policy needs more is locked down (deny all) until it fits",
    )
    node_labels: tuple[str, ...] = option(
        (),
        "this node's labels (key=value, comma-separated), registered with ipam: host "
        "policies select nodes by them",
        parse=parse_node_label,
    )
    host_policy_safety: str = option(
        "on",
        "on: the node's traffic with etcd and the control-plane services it is configured "
        "with passes before any host policy (off: the host policy alone decides)",
        choices=("on", "off"),
    )
    flow_buffer_capacity: int = option(
        4096,
        "flows kept for the history ObserveFlows sends first (`flagella observe --last`), "
        "as Hubble's --hubble-event-buffer-capacity; each a few hundred bytes",
    )
    map_event_history: int = option(
        DEFAULT_MAP_EVENT_HISTORY,
        "writes kept per BPF map for GetMapEvents (`flagella map events`), each about "
        "60 bytes plus the map's key and value; 0: none kept",
    )

    prefilter_devices: tuple[str, ...] = option(
        (),
        "devices the XDP prefilter runs on (comma-separated); empty: the node's devices "
        "(--uplink); none: no device",
        parse=parse_ifname,
    )

    dns_proxy_port: int = option(
        10053,
        "port of the node's DNS proxy, where the DNS of pods with toFQDNs rules is "
        "redirected (bound on every address, transparent); 0: no proxy",
    )
    dns_proxy_upstream_timeout: float = option(
        2.0, "seconds the DNS proxy waits for the server a pod asked before answering SERVFAIL"
    )
    dns_proxy_response_max_delay: float = option(
        1.0,
        "seconds at most a DNS answer is held until this node applied what it taught the "
        "policy service (as Cilium's tofqdns-proxy-response-max-delay)",
    )
    tofqdns_gc_interval_seconds: float = option(
        10.0,
        "how often this node's expired FQDN cache entries without a live connection are deleted",
    )
    tofqdns_min_ttl: int = option(
        0, "minimum seconds an answer's addresses stay in the FQDN cache (Cilium's tofqdns-min-ttl)"
    )
    bgp_listen_port: int = option(
        179, "TCP port the BGP speaker (gobgpd) listens on, on the node's addresses"
    )
    bgp_gobgpd: str = option("gobgpd", "the gobgpd binary (Debian's gobgpd, GoBGP 3.10)")
    bgp_user: str = option(
        "",
        "user gobgpd runs as (empty: the datapath's own, uid 0); in any case with "
        "CAP_NET_BIND_SERVICE as its only capability. Another user needs every folder above "
        "--state-dir searchable by it (gobgpd makes its API socket under <state-dir>/bgp/run)",
    )

    def tls_identity(self, service: str) -> Identity:
        # The datapath registers its node (and asks for its node's policy):
        # it holds the node's certificate.
        return Identity("node", self.node_name)

    def validate(self) -> None:
        super().validate()
        if not self.node_name:
            raise ConfigError("--node-name", "must not be empty")
        if not self.cni_socket.startswith("/") or len(self.cni_socket.encode()) > 107:
            raise ConfigError("--cni-socket", "must be an absolute path of at most 107 bytes")
        try:
            self.tls_identity("datapath")  # its certificate names it
        except ValueError as exc:
            raise ConfigError("--node-name", str(exc)) from None
        if self.gc_interval_seconds <= 0:
            raise ConfigError("--gc-interval-seconds", "must be positive")
        if not 1 <= self.flow_buffer_capacity <= MAX_FLOW_BUFFER:
            raise ConfigError(
                "--flow-buffer-capacity",
                f"{self.flow_buffer_capacity} is not in 1..{MAX_FLOW_BUFFER}",
            )
        if not 0 <= self.map_event_history <= MAX_MAP_EVENT_HISTORY:
            raise ConfigError(
                "--map-event-history",
                f"{self.map_event_history} is not in 0..{MAX_MAP_EVENT_HISTORY}",
            )
        if not 1 <= self.policy_map_max_entries <= MAX_POLICY_BUDGET:
            raise ConfigError(
                "--policy-map-max-entries",
                f"{self.policy_map_max_entries} is not in 1..{MAX_POLICY_BUDGET}",
            )
        if self.routing_mode not in ROUTING_MODES:
            raise ConfigError(
                "--routing-mode", f"{self.routing_mode!r} is not one of {', '.join(ROUTING_MODES)}"
            )
        if not 1 <= self.tunnel_port <= 65535:
            raise ConfigError("--tunnel-port", f"{self.tunnel_port} is not in 1..65535")
        if not 0 <= self.health_port <= 65535:
            raise ConfigError("--health-port", f"{self.health_port} is not in 0..65535")
        if not 0 <= self.dns_proxy_port <= 65535:
            raise ConfigError("--dns-proxy-port", f"{self.dns_proxy_port} is not in 0..65535")
        if self.dns_proxy_upstream_timeout <= 0:
            raise ConfigError("--dns-proxy-upstream-timeout", "must be positive")
        if self.dns_proxy_response_max_delay <= 0:
            raise ConfigError("--dns-proxy-response-max-delay", "must be positive")
        if self.tofqdns_gc_interval_seconds <= 0:
            raise ConfigError("--tofqdns-gc-interval-seconds", "must be positive")
        if not 0 <= self.tofqdns_min_ttl <= 7 * 86400:
            raise ConfigError("--tofqdns-min-ttl", f"{self.tofqdns_min_ttl} is not in 0..604800")
        if self.health_interval_seconds <= 0:
            raise ConfigError("--health-interval-seconds", "must be positive")
        if not 1 <= self.bgp_listen_port <= 65535:
            raise ConfigError("--bgp-listen-port", f"{self.bgp_listen_port} is not in 1..65535")
        versions: set[int] = set()
        for ip in self.node_ip:
            version = ipaddress.ip_address(ip).version
            if version in versions:
                raise ConfigError(
                    "--node-ip", f"{ip} is a second IPv{version} address (one per family)"
                )
            versions.add(version)
        if "none" in self.prefilter_devices and len(self.prefilter_devices) > 1:
            raise ConfigError("--prefilter-devices", "none stands alone")
        if self.tunnel and versions and 4 not in versions:
            raise ConfigError("--node-ip", "tunnel mode needs an IPv4 node IP (the underlay)")

    @property
    def labels(self) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in self.node_labels)

    @property
    def prefilter_device_names(self) -> tuple[str, ...]:
        if self.prefilter_devices == ("none",):
            return ()
        if self.prefilter_devices:
            return self.prefilter_devices
        return (self.uplink,) if self.uplink else ()

    @property
    def tunnel(self) -> bool:
        return self.routing_mode == "tunnel"
