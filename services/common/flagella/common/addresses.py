"""Where a peer service is: one address, or its replicas' addresses, as a
gRPC target whose own resolver and load balancer pick a live replica.

An address option takes `host:port`, `unix:PATH`, a gRPC target such as
`dns:///ipam.flagella:50051` (a name resolving to every replica), or a
comma-separated list of replicas: IP `host:port`s of one family (`ipv4:`/
`ipv6:` targets) or `unix:` sockets. gRPC's pick_first, with the list
shuffled per channel (so clients spread over the replicas), keeps one
connection and moves to the next address when it breaks: no retry loop
over addresses of our own. Reads (Get*, List*, Watch* ... never a write)
that fail with UNAVAILABLE are retried by gRPC's retry policy, with its
jittered exponential backoff, on whichever replica is picked next; a write
whose outcome is unknown is left to its caller (an ADD fails with CNI code
11 after rolling back, and the runtime retries it).

mTLS: every replica's certificate names the service (certgen issues
`<svc>`, `<svc>.flagella.svc`, ...), so a list of IPs is verified against
the service's name; a unix socket's server answers as `localhost`.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.api.relay.v1 import relay_pb2
from flagella.common.config import option

# Methods that change nothing: safe to send again to another replica.
_READ = re.compile(r"^(Get|List|Watch|Observe|Resolve|Trace|Dump|WaitFor|Check)[A-Z]")
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")


@dataclass(frozen=True, slots=True)
class Target:
    """A gRPC target and the name the server's certificate must carry
    ("" : the target's own host)."""

    target: str
    tls_name: str = ""


def split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _ip_family(address: str) -> int | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).version
    except ValueError:
        return None


def target(value: str, service: str = "") -> Target:
    """The gRPC target of an address option's value (see the module doc);
    service is the peer's name, which its certificate carries. Raises
    ValueError naming what is wrong."""
    value = value.strip()
    if value.startswith(("ipv4:", "ipv6:")):  # gRPC's own address lists
        return Target(value, service)
    if value.startswith(("dns:", "unix-abstract:")):
        return Target(value)
    parts = split(value)
    if not parts:
        raise ValueError("no address")
    if len(parts) == 1:
        one = parts[0]
        return Target(one, "localhost") if one.startswith("unix:") else Target(one)
    if all(p.startswith("unix:") and len(p) > len("unix:") for p in parts):
        return Target("unix:" + ",".join(p.removeprefix("unix:") for p in parts), "localhost")
    families = {_ip_family(p) for p in parts}
    if families in ({4}, {6}):
        scheme = "ipv4" if families == {4} else "ipv6"
        return Target(f"{scheme}:{','.join(parts)}", service)
    raise ValueError(
        f"{value!r}: a list of replicas is IP host:port addresses of one family or unix: "
        "sockets; for names, give one name that resolves to every replica (dns:///NAME:PORT)"
    )


def host_ports(value: str) -> list[tuple[str, int]]:
    """(host, port) of every TCP address an option names (a replica list,
    dns:///NAME:PORT, ipv4:/ipv6: lists); unix sockets have none."""
    value = value.strip()
    if value.startswith(("unix:", "unix-abstract:")):
        return []
    value = re.sub(r"^(dns:(//[^/]*)?/?|ipv4:|ipv6:)", "", value)
    out = []
    for part in split(value):
        host, sep, port = part.rpartition(":")
        if sep and host and port.isdigit():
            out.append((host.removeprefix("[").removesuffix("]"), int(port)))
    return out


def parse_addresses(value: str) -> str:
    """Config parser of an address option: one address or a list (empty:
    none, where the option allows it)."""
    if not value.strip():
        return ""
    if value.strip().startswith(_SCHEMES) and not value.strip().startswith("unix:"):
        return value.strip()
    for part in split(value):
        if part.startswith("unix:"):
            if part == "unix:":
                raise ValueError("unix: needs a socket path")
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{part!r} is not host:port (port 1-65535), unix:PATH or dns:///")
    target(value)
    return ",".join(split(value))


def address_option(default: str, help: str) -> Any:
    """A config field naming a peer service: one address or its replicas'."""
    return option(
        default, f"{help}; host:port, unix:PATH, dns:///NAME:PORT or a list", parse=parse_addresses
    )


def _read_methods() -> list[dict[str, str]]:
    names = []
    for module in (datapath_pb2, endpoint_pb2, ipam_pb2, lb_pb2, policy_pb2, relay_pb2):
        for svc in module.DESCRIPTOR.services_by_name.values():
            names += [
                {"service": svc.full_name, "method": m.name}
                for m in svc.methods
                if _READ.match(m.name)
            ]
    return names


@functools.cache
def service_config() -> str:
    """The channels' service config: pick_first over the shuffled list,
    reads retried on UNAVAILABLE (gRPC jitters each backoff)."""
    config: dict[str, Any] = {
        "loadBalancingConfig": [{"pick_first": {"shuffleAddressList": True}}],
        "methodConfig": [
            {
                "name": _read_methods(),
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
    return json.dumps(config)


def channel_options(tgt: Target) -> list[tuple[str, Any]]:
    """Options of a channel to tgt: its service config, and the name to
    verify the server's certificate against."""
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", service_config()),
        ("grpc.service_config_disable_resolution", 1),
        ("grpc.enable_retries", 1),
    ]
    if tgt.tls_name:
        options.append(("grpc.ssl_target_name_override", tgt.tls_name))
    return options
