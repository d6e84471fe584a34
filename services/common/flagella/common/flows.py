"""Flows in Hubble's shape: a datapath Flow, with what is known about both
ends, as one line of `hubble observe -o json` (observer.proto's
GetFlowsResponse with flow.proto's Flow, in protobuf's JSON mapping), and
the filters hubble applies to ends it knows by name.

One place for every consumer (`flagella observe`, and the flow relay's web
page), so all of them print the same flow the same way. Pure: the callers
fetch the endpoints and identities (`directory()` makes the `Directory`
from their answers) and reload them when `stale()` says so.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flagella.api.datapath.v1 import datapath_pb2 as dp
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2

# Cilium's DropReason names (flow.proto) for flagella's reasons. Most share
# Cilium's number; POLICY_L4 (230) is what Cilium reports as POLICY_DENIED;
# a reason Cilium has no name for is DROP_REASON_UNKNOWN, its number kept in
# drop_reason.
DROP_REASON_DESC: Mapping[int, str] = {
    dp.DROP_REASON_UNSPECIFIED: "DROP_REASON_UNKNOWN",
    dp.DROP_REASON_INVALID_SOURCE_IP: "INVALID_SOURCE_IP",
    dp.DROP_REASON_POLICY_L3: "POLICY_DENIED",
    dp.DROP_REASON_INVALID_PACKET: "INVALID_PACKET_DROPPED",
    dp.DROP_REASON_CT_INVALID: "CT_TRUNCATED_OR_INVALID_HEADER",
    dp.DROP_REASON_UNSUPPORTED_L3: "UNSUPPORTED_L3_PROTOCOL",
    dp.DROP_REASON_UNKNOWN_ENDPOINT: "NO_MATCHING_LOCAL_CONTAINER_FOUND",
    dp.DROP_REASON_CT_INSERT_FAILED: "CT_MAP_INSERTION_FAILED",
    dp.DROP_REASON_NO_BACKEND: "SERVICE_BACKEND_NOT_FOUND",
    dp.DROP_REASON_NO_TUNNEL_ENDPOINT: "NO_TUNNEL_OR_ENCAPSULATION_ENDPOINT",
    dp.DROP_REASON_POLICY_NOT_READY: "NO_CONFIGURATION_AVAILABLE_TO_PERFORM_POLICY_DECISION",
    dp.DROP_REASON_NAT_FAILED: "NO_MAPPING_FOR_NAT_MASQUERADE",
    dp.DROP_REASON_FIB_LOOKUP_FAILED: "FIB_LOOKUP_FAILED",
    dp.DROP_REASON_FRAG_NOT_SUPPORTED: "FIRST_LOGICAL_DATAGRAM_FRAGMENT_NOT_FOUND",
    dp.DROP_REASON_SOURCE_RANGE: "DENIED_BY_LB_SRC_RANGE_CHECK",
    dp.DROP_REASON_POLICY_DENY: "POLICY_DENY",
    dp.DROP_REASON_TTL_EXCEEDED: "TTL_EXCEEDED",
    dp.DROP_REASON_POLICY_L4: "POLICY_DENIED",
    dp.DROP_REASON_REDIRECT_FAILED: "DROP_REASON_UNKNOWN",
    dp.DROP_REASON_UNKNOWN_NODE: "DROP_REASON_UNKNOWN",
}

# Cilium's monitor message types (pkg/monitor/api), Hubble's event_type.type.
_EVENT_DROP = 1
_EVENT_TRACE = 4
_EVENT_POLICY_VERDICT = 9
_EVENT_ACCESS_LOG = 129  # L7 records (the DNS proxy's)

_TCP_FLAGS = ("FIN", "SYN", "RST", "PSH", "ACK", "URG", "ECE", "CWR")  # bit 0 .. 7
_UNREACH, _TIME = "DestinationUnreachable", "TimeExceeded"
_ICMP4_NAMES = {0: "EchoReply", 3: _UNREACH, 8: "EchoRequest", 11: _TIME}
_ICMP6_NAMES = {1: _UNREACH, 3: _TIME, 128: "EchoRequest", 129: "EchoReply"}
_L4_PORTS = {6: "TCP", 17: "UDP", 132: "SCTP"}
_U32 = 1 << 32
# A flow naming an end the directory does not know reloads it at most this
# often (a pod created since; not on every flow of a pod deleted since).
REFRESH_SECONDS = 1.0


def drop_reasons(spec: str) -> list[dp.DropReason.ValueType]:
    """The reason numbers a --drop-reason names: a number, a Cilium name
    (POLICY_DENIED: 133 and 230) or flagella's (POLICY_L4, policy-l4)."""
    if spec.isdigit():
        return [dp.DropReason.ValueType(int(spec))]
    name = spec.upper().replace("-", "_")
    found = [dp.DropReason.ValueType(n) for n, d in DROP_REASON_DESC.items() if d == name and n]
    ours = f"DROP_REASON_{name}"
    found = found or [v for v in dp.DropReason.values() if dp.DropReason.Name(v) == ours]
    if not found:
        raise ValueError(f"unknown drop reason {spec!r}")
    return sorted(found)


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    endpoint_id: int
    node: str


@dataclass
class Directory:
    """What the consumer knows of the cluster: pods by IP, labels by
    identity (each as Cilium writes it, `k8s:app=db`, `reserved:world`),
    services (namespace, name) by frontend (IP, port)."""

    pods: dict[str, Pod] = field(default_factory=dict)
    labels: dict[int, tuple[str, ...]] = field(default_factory=dict)
    services: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)

    def knows(self, f: dp.Flow) -> bool:
        """Whether both ends are known: their identity, and the pod of an
        end with a pod's identity (cluster-wide, 256-65535)."""
        return all(
            ident in self.labels and (ip in self.pods or not 256 <= ident <= 65535)
            for ip, ident in ((f.src_ip, f.src_identity), (f.dst_ip, f.dst_identity))
        )

    def endpoint(self, ip: str, identity: int, local_id: int) -> dict[str, Any]:
        """flow.proto's Endpoint of one end."""
        labels = self.labels.get(identity, ())
        pod = self.pods.get(ip)
        namespace = pod.namespace if pod else _label_value(labels, "io.kubernetes.pod.namespace")
        ep_id = local_id or (pod.endpoint_id if pod else 0)
        out: dict[str, Any] = {
            "ID": ep_id if 0 < ep_id < _U32 else 0,
            "identity": identity,
            "namespace": namespace,
            "labels": sorted(labels),
            "pod_name": pod.name if pod else "",
        }
        return {k: v for k, v in out.items() if v}


def label_text(label: policy_pb2.Label) -> str:
    """As Cilium writes a label: source:key=value, source:key without a value."""
    text = f"{label.source}:{label.key}"
    return f"{text}={label.value}" if label.value else text


def directory(
    endpoints: Iterable[endpoint_pb2.Endpoint],
    identities: Iterable[policy_pb2.Identity],
    services: Iterable[lb_pb2.Service] = (),
) -> Directory:
    """The Directory of the endpoint service's ListEndpoints, the policy
    service's ListIdentities and the lb service's ListServices."""
    pods = {
        address.split("/")[0]: Pod(e.pod_name, e.pod_namespace, e.id, e.node)
        for e in endpoints
        if e.pod_name
        for address in e.addresses
    }
    labels = {i.id: tuple(label_text(lb) for lb in i.labels) for i in identities}
    frontends = {}
    for svc in services:
        prefix, _, name = svc.name.rpartition("/")
        key = (svc.frontend.address, svc.frontend.port)
        frontends[key] = (svc.namespace or prefix, name)
    return Directory(pods, labels, frontends)


def stale(known: Directory, f: dp.Flow, loaded_at: float, now: float) -> bool:
    """Whether to reload the directory before showing f: an end it does
    not know, and the last load at least REFRESH_SECONDS ago."""
    return not known.knows(f) and now - loaded_at >= REFRESH_SECONDS


def _label_value(labels: Iterable[str], key: str) -> str:
    for label in labels:
        _, _, kv = label.partition(":")
        k, eq, v = kv.partition("=")
        if eq and k == key:
            return v
    return ""


def _l4(f: dp.Flow) -> tuple[dict[str, Any], str]:
    """flow.proto's Layer4 and the summary hubble prints for it."""
    if f.protocol in _L4_PORTS:
        name = _L4_PORTS[f.protocol]
        body: dict[str, Any] = {"source_port": f.src_port, "destination_port": f.dst_port}
        summary = name
        if f.protocol == 6:
            flags = [n for bit, n in enumerate(_TCP_FLAGS) if f.tcp_flags & (1 << bit)]
            body["flags"] = dict.fromkeys(flags, True)
            summary = f"TCP Flags: {', '.join(flags)}"
        return {name: {k: v for k, v in body.items() if v}}, summary
    if f.protocol in (1, 58):
        name, names = ("ICMPv4", _ICMP4_NAMES) if f.protocol == 1 else ("ICMPv6", _ICMP6_NAMES)
        kind = names.get(f.icmp_type, f"type {f.icmp_type}")
        return {name: {"type": f.icmp_type} if f.icmp_type else {}}, f"{name} {kind}"
    return {}, f"IP protocol {f.protocol}"


def _policy_ref(rule: str) -> dict[str, str]:
    """flow.proto's Policy of a rule key ("namespace/name" or "name")."""
    namespace, _, name = rule.rpartition("/")
    return {"name": name, "namespace": namespace} if namespace else {"name": name}


def to_hubble(f: dp.Flow, directory: Directory) -> dict[str, Any]:
    """One `hubble observe -o json` line: {"flow": ..., "node_name", "time"}."""
    time = f.time.ToJsonString()
    ingress = f.direction == dp.FLOW_DIRECTION_INGRESS
    egress = f.direction == dp.FLOW_DIRECTION_EGRESS
    # The local endpoint is the destination of an ingress flow, the source
    # of an egress one; the host endpoint (2^64-1) has no Cilium endpoint id.
    local = f.endpoint_id if f.endpoint_id < _U32 else 0
    l4, summary = _l4(f)
    dropped = f.verdict == dp.FLOW_VERDICT_DROPPED
    flow: dict[str, Any] = {
        "time": time,
        "verdict": {1: "FORWARDED", 2: "DROPPED", 4: "AUDIT"}.get(f.verdict, "VERDICT_UNKNOWN"),
        "drop_reason": f.drop_reason if dropped else 0,
        "IP": {
            "source": f.src_ip,
            "destination": f.dst_ip,
            "ipVersion": "IPv6" if ":" in f.src_ip else "IPv4",
        },
        "l4": l4,
        "source": directory.endpoint(f.src_ip, f.src_identity, local if egress else 0),
        "destination": directory.endpoint(f.dst_ip, f.dst_identity, local if ingress else 0),
        "Type": "L3_L4",
        "node_name": f.node,
        "event_type": {
            "type": {
                dp.FLOW_TYPE_DROP: _EVENT_DROP,
                dp.FLOW_TYPE_TRACE: _EVENT_TRACE,
            }.get(f.type, _EVENT_POLICY_VERDICT),
            "sub_type": f.drop_reason if f.type == dp.FLOW_TYPE_DROP else 0,
        },
        "traffic_direction": "INGRESS" if ingress else "EGRESS" if egress else "",
        "drop_reason_desc": DROP_REASON_DESC.get(f.drop_reason, "DROP_REASON_UNKNOWN")
        if dropped
        else "",
        "interface": {"index": f.ifindex} if f.ifindex else {},
        "Summary": summary,
    }
    # The rule set that denies (or, AUDIT, would deny) it, as Hubble's
    # ingress_denied_by / egress_denied_by name policies.
    if f.denied_by:
        key = "ingress_denied_by" if ingress else "egress_denied_by"
        flow[key] = [_policy_ref(name) for name in f.denied_by]
    if f.type == dp.FLOW_TYPE_L7:
        flow.update(_l7(f))
    # A flow still addressed to a service's frontend (seen before its
    # translation, e.g. dropped for want of a backend), as hubble names it.
    service = directory.services.get((f.dst_ip, f.dst_port))
    if service:
        flow["destination_service"] = {
            k: v for k, v in (("namespace", service[0]), ("name", service[1])) if v
        }
    # protobuf's JSON mapping leaves out what is unset, as hubble's output does.
    flow = {k: v for k, v in flow.items() if v}
    flow["event_type"] = {k: v for k, v in flow["event_type"].items() if v}
    return {"flow": flow, "node_name": f.node, "time": time}


def _l7(f: dp.Flow) -> dict[str, Any]:
    """Hubble's L7 DNS record of a flow of the DNS proxy: a refused query is
    a REQUEST, an answered one a RESPONSE."""
    d = f.dns
    record: dict[str, Any] = {"query": f"{d.query}." if d.query else ""}
    if d.ips:
        record["ips"] = list(d.ips)
    if d.ttl:
        record["ttl"] = d.ttl
    if d.rcode:
        record["rcode"] = d.rcode
    if d.qtypes:
        record["qtypes"] = list(d.qtypes)
    response = f.verdict == dp.FLOW_VERDICT_FORWARDED
    return {
        "Type": "L7",
        "event_type": {"type": _EVENT_ACCESS_LOG},
        "l7": {"type": "RESPONSE" if response else "REQUEST", "dns": record},
        "Summary": f"DNS {'Answer' if response else 'Query'} {d.query}. "
        f"{','.join(d.qtypes)} rcode {d.rcode}",
    }


def node_status(node: str, connected: bool, message: str, time: str) -> dict[str, Any]:
    """A relay's node status line as `hubble observe -o json` prints it
    (observer.proto's GetFlowsResponse holding relay.proto's NodeStatusEvent)."""
    event: dict[str, Any] = {
        "state_change": "NODE_CONNECTED" if connected else "NODE_UNAVAILABLE",
        "node_names": [node],
    }
    if message:
        event["message"] = message
    return {"node_status": event, "time": time}


def lost_events(node: str, count: int, time: str) -> dict[str, Any]:
    """Flows a relay dropped from a node's full queue, as hubble prints a
    LostEvent (source: the queue between a node and its reader; uint64 as
    a string, protobuf's JSON mapping)."""
    event = {"source": "OBSERVER_EVENTS_QUEUE", "num_events_lost": str(count)}
    return {"lost_events": event, "node_name": node, "time": time}


# --- filters on what only a consumer knows (names, namespaces, labels) ---


@dataclass(frozen=True)
class Selector:
    """A label selector as hubble's --label takes it: comma-separated
    `key=value`, `key!=value`, `key` (exists), `!key`; keys with or without
    their source (`app`, `k8s:app`)."""

    requirements: tuple[tuple[str, str, str], ...]  # (op, key, value)

    @classmethod
    def parse(cls, text: str) -> Selector:
        reqs = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if "!=" in part:
                key, value = part.split("!=", 1)
                reqs.append(("!=", key.strip(), value.strip()))
            elif "=" in part:
                key, value = part.split("=", 1)
                reqs.append(("=", key.strip(), value.strip().removeprefix("=")))
            elif part.startswith("!"):
                reqs.append(("!", part[1:].strip(), ""))
            else:
                reqs.append(("exists", part, ""))
        if not reqs or any(not key for _, key, _ in reqs):
            raise ValueError(f"invalid label selector {text!r}")
        return cls(tuple(reqs))

    def matches(self, labels: Sequence[str]) -> bool:
        values: dict[str, str] = {}
        for label in labels:
            source, _, kv = label.partition(":")
            key, _, value = kv.partition("=")
            values[key] = values[f"{source}:{key}"] = value
        for op, key, value in self.requirements:
            have = values.get(key)
            if (op == "exists" and have is None) or (op == "!" and have is not None):
                return False
            if (op == "=" and have != value) or (op == "!=" and have == value):
                return False
        return True


@dataclass(frozen=True)
class EndFilter:
    """Hubble's filters of one end (`--pod`, `--namespace`, `--label`,
    `--identity`): a flow matches when its source or its destination
    matches all of them; `nodes` (globs) names where it was seen."""

    pods: tuple[str, ...] = ()  # "[namespace/]pod-name-prefix"
    namespaces: tuple[str, ...] = ()
    labels: tuple[Selector, ...] = ()
    identities: frozenset[int] = frozenset()
    nodes: tuple[str, ...] = ()

    @property
    def by_end(self) -> bool:
        return bool(self.pods or self.namespaces or self.labels or self.identities)

    def _end(self, ep: Mapping[str, Any]) -> bool:
        ns, name = ep.get("namespace", ""), ep.get("pod_name", "")
        if self.namespaces and ns not in self.namespaces:
            return False
        if self.pods and not any(_pod_matches(p, ns, name) for p in self.pods):
            return False
        if self.identities and ep.get("identity", 0) not in self.identities:
            return False
        labels = ep.get("labels", [])
        return all(s.matches(labels) for s in self.labels)

    def matches(self, hubble: Mapping[str, Any]) -> bool:
        flow = hubble["flow"]
        if self.nodes and not any(fnmatch.fnmatch(hubble["node_name"], n) for n in self.nodes):
            return False
        if not self.by_end:
            return True
        return self._end(flow.get("source", {})) or self._end(flow.get("destination", {}))


def _pod_matches(spec: str, namespace: str, name: str) -> bool:
    want_ns, slash, prefix = spec.rpartition("/")
    if slash and want_ns != namespace:
        return False
    return bool(name) and name.startswith(prefix)
