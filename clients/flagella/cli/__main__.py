"""flagella: the operator CLI, as the `cilium` agent CLI is.

Service addresses come from flags, else from the environment (targets.py);
each node's datapath from the node registry. Tables for people, `-o json`
for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.cli import certs
from flagella.cli.targets import SERVICES, Datapath, default_address, default_node, pick_one
from flagella.common.tls import target_options

STATUS_NAMES = {
    health_pb2.HealthCheckResponse.SERVING: "SERVING",
    health_pb2.HealthCheckResponse.NOT_SERVING: "NOT_SERVING",
    health_pb2.HealthCheckResponse.UNKNOWN: "UNKNOWN",
    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: "SERVICE_UNKNOWN",
}
PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132, "icmp": 1, "any": 0}
PROTOCOL_NAMES = {v: k.upper() for k, v in PROTOCOLS.items()}


class CliError(Exception):
    """A failure to report as one line, exit status 1."""


def enum_name(enum: Any, value: int, prefix: str) -> str:
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).lower().replace("_", "-")


def drop_reason_words(code: int) -> str:
    """A drop reason in words, e.g. "policy denied (L3)"."""
    words: dict[int, str] = {
        datapath_pb2.DROP_REASON_POLICY_L3: "policy denied (L3: peer identity not allowed)",
        datapath_pb2.DROP_REASON_POLICY_L4: "policy denied (L4: port not allowed)",
        datapath_pb2.DROP_REASON_POLICY_DENY: "policy denied by a deny rule",
        datapath_pb2.DROP_REASON_POLICY_NOT_READY: "endpoint policy not loaded yet",
        datapath_pb2.DROP_REASON_NO_BACKEND: "service has no backend",
        datapath_pb2.DROP_REASON_SOURCE_RANGE: "source not in the service's allowed ranges",
        datapath_pb2.DROP_REASON_CT_INSERT_FAILED: "conntrack insert failed",
        datapath_pb2.DROP_REASON_CT_INVALID: "invalid conntrack state",
        datapath_pb2.DROP_REASON_NAT_FAILED: "NAT failed",
        datapath_pb2.DROP_REASON_INVALID_PACKET: "invalid packet",
        datapath_pb2.DROP_REASON_UNSUPPORTED_L3: "unsupported L3 protocol",
        datapath_pb2.DROP_REASON_UNKNOWN_ENDPOINT: "unknown endpoint",
        datapath_pb2.DROP_REASON_FIB_LOOKUP_FAILED: "no route (FIB lookup failed)",
        datapath_pb2.DROP_REASON_REDIRECT_FAILED: "redirect failed",
    }
    return words.get(code, enum_name(datapath_pb2.DropReason, code, "DROP_REASON_"))


# --- output ---


def to_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True)


def emit(
    args: argparse.Namespace, data: Any, headers: Sequence[str], rows: Iterable[Sequence[Any]]
) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


class Clients:
    """One channel per service, opened on first use."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._channels: dict[str, grpc.Channel] = {}
        self._credentials: grpc.ChannelCredentials | None = None

    def open(self, address: str) -> grpc.Channel:
        """A channel presenting the operator certificate (plaintext with --insecure)."""
        if self.args.insecure:
            return grpc.insecure_channel(address)
        if self._credentials is None:
            try:
                self._credentials = certs.channel_credentials(self.args)
            except certs.CertsError as exc:
                raise CliError(str(exc)) from None
        return grpc.secure_channel(address, self._credentials, options=target_options(address))

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = self.open(address)
        return self._channels[address]

    def call(self, svc: str, fn: Callable[..., Any], request: Message, **kwargs: Any) -> Any:
        address = getattr(self.args, f"{svc}_address")
        return self.call_at(f"{svc} service", svc, address, fn, request, **kwargs)

    def call_at(
        self,
        what: str,
        label: str,
        address: str,
        fn: Callable[..., Any],
        request: Message,
        **kwargs: Any,
    ) -> Any:
        """fn(request); a failure as one line naming what was called where."""
        try:
            return fn(request, timeout=kwargs.pop("timeout", self.args.timeout), **kwargs)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CliError(f"{what} unreachable at {address}: {details}") from None
            raise CliError(f"{label}: {code.name if code else 'error'}: {details}") from None

    def call_datapath(self, dp: Datapath, method: str, request: Message) -> Any:
        what = f"datapath of node {dp.node}" if dp.node else "datapath service"
        fn = getattr(self.datapath(dp), method)
        return self.call_at(what, dp.label, dp.address, fn, request)

    def ipam(self) -> Any:
        return ipam_pb2_grpc.IpamServiceStub(self.channel(self.args.ipam_address))

    def policy(self) -> Any:
        return policy_pb2_grpc.PolicyServiceStub(self.channel(self.args.policy_address))

    def endpoint(self) -> Any:
        return endpoint_pb2_grpc.EndpointServiceStub(self.channel(self.args.endpoint_address))

    def lb(self) -> Any:
        return lb_pb2_grpc.LoadBalancerServiceStub(self.channel(self.args.lb_address))

    def datapath(self, dp: Datapath) -> Any:
        return datapath_pb2_grpc.DatapathServiceStub(self.channel(dp.address))

    def registered(self) -> dict[str, str]:
        """node -> its datapath's address, from the node registry."""
        nodes = self.call("ipam", self.ipam().ListNodes, ipam_pb2.ListNodesRequest()).nodes
        return {n.name: n.datapath_address for n in nodes if n.datapath_address}

    def datapaths(self, node: str = "", *, one: bool = False) -> list[Datapath]:
        """The datapaths a command talks to: --datapath-address; else the
        registry's: the node named, the node this runs on for a one-node
        command (one), or every node."""
        if self.args.datapath_address:
            if node:
                raise CliError("--node and --datapath-address name the same thing: give one")
            return [Datapath("", self.args.datapath_address)]
        registered = self.registered()
        if node or one:
            try:
                return [pick_one(registered, node, default_node(os.environ) if one else "")]
            except LookupError as exc:
                raise CliError(str(exc)) from None
        if not registered:
            raise CliError(
                f"no node has registered a datapath with ipam at {self.args.ipam_address} "
                "(give --datapath-address)"
            )
        return [Datapath(n, a) for n, a in sorted(registered.items())]


# --- status ---


def check_health(clients: Clients, address: str, timeout: float) -> tuple[str, str]:
    """(status, detail) of one service's gRPC health."""
    with clients.open(address) as channel:
        # The health stub's type stubs lack its methods.
        stub: Any = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return "DOWN", f"{code.name if code else 'error'}: unreachable at {address}"
        return STATUS_NAMES.get(resp.status, str(resp.status)), address


def node_health(args: argparse.Namespace, clients: Clients) -> int:
    """`status --nodes`: every node's datapath, found through the node
    registry, and how it sees the other nodes (reachability, latency)."""
    nodes = clients.call("ipam", clients.ipam().ListNodes, ipam_pb2.ListNodesRequest()).nodes
    names = sorted(n.name for n in nodes)
    data: dict[str, Any] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        entry: dict[str, Any] = {"datapath": node.datapath_address, "peers": {}}
        try:
            status = clients.call_datapath(
                Datapath(node.name, node.datapath_address),
                "GetStatus",
                datapath_pb2.GetStatusRequest(),
            )
        except CliError as exc:
            entry["error"] = str(exc)
            data[node.name] = entry
            continue
        for p in status.peers:
            entry["peers"][p.node] = {
                "ip": p.ip,
                "reachable": p.reachable,
                "latency_ms": round(p.latency.ToNanoseconds() / 1e6, 3),
                "error": p.error,
            }
        data[node.name] = entry

    def cell(src: str, dst: str) -> str:
        if src == dst:
            return "-"
        if "error" in data[src]:
            return "?"
        peer = data[src]["peers"].get(dst)
        if peer is None:
            return "not probed"
        return f"{peer['latency_ms']:.2f}ms" if peer["reachable"] else "UNREACHABLE"

    emit(
        args,
        {"nodes": data},
        ["FROM \\ TO", *names],
        [[s, *(cell(s, d) for d in names)] for s in names],
    )
    if args.output != "json":
        for name in names:
            if "error" in data[name]:
                print(f"{name}: {data[name]['error']} at {data[name]['datapath']}")
    healthy = all(
        "error" not in e and all(p["reachable"] for p in e["peers"].values()) for e in data.values()
    )
    return 0 if healthy else 1


def datapath_health(
    clients: Clients, node: str, timeout: float
) -> tuple[dict[str, tuple[str, str]], list[Datapath]]:
    """Health rows of the datapaths `status` covers, and those serving."""
    try:
        targets = clients.datapaths(node)
    except CliError as exc:
        return {"datapath": ("DOWN", str(exc))}, []
    rows = {dp.label: check_health(clients, dp.address, timeout) for dp in targets}
    return rows, [dp for dp in targets if rows[dp.label][0] == "SERVING"]


def map_pressure(clients: Clients, serving: list[Datapath]) -> list[dict[str, Any]]:
    maps: list[dict[str, Any]] = []
    for dp in serving:
        node = {"node": dp.node} if dp.node else {}
        try:
            status = clients.call_datapath(dp, "GetStatus", datapath_pb2.GetStatusRequest())
        except CliError as exc:
            maps.append({**node, "name": "?", "error": str(exc)})
            continue
        maps += [
            {**node, "name": m.name, "entries": m.entries, "max_entries": m.max_entries}
            for m in status.maps
        ]
    return maps


def cmd_status(args: argparse.Namespace, clients: Clients) -> int:
    if args.nodes:
        return node_health(args, clients)
    deadline = time.monotonic() + args.wait
    while True:
        rows = {
            svc: check_health(clients, getattr(args, f"{svc}_address"), args.timeout)
            for svc in SERVICES
        }
        datapaths, serving = datapath_health(clients, args.node or "", args.timeout)
        rows.update(datapaths)
        healthy = all(status == "SERVING" for status, _ in rows.values())
        if healthy or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    maps = [] if args.brief else map_pressure(clients, serving)
    data = {
        "services": {svc: {"status": s, "detail": d} for svc, (s, d) in rows.items()},
        "maps": maps,
    }
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        emit(args, data, ["SERVICE", "STATUS", "DETAIL"], [[k, s, d] for k, (s, d) in rows.items()])
        if maps:
            print()
            by_node = any("node" in m for m in maps)
            emit(
                args,
                None,
                [*(["NODE"] if by_node else []), "MAP", "ENTRIES", "MAX", "PRESSURE"],
                [
                    [
                        *([m.get("node", "")] if by_node else []),
                        m["name"],
                        m.get("entries", "?"),
                        m.get("max_entries", "?"),
                        f"{100 * m['entries'] / m['max_entries']:.1f}%"
                        if m.get("max_entries")
                        else "-",
                    ]
                    for m in maps
                ],
            )
    return 0 if healthy else 1


# --- endpoints ---


def cmd_endpoint(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.endpoint()
    if args.action == "list":
        resp = clients.call(
            "endpoint",
            stub.ListEndpoints,
            endpoint_pb2.ListEndpointsRequest(
                node=args.node or "", pod_namespace=args.namespace or ""
            ),
        )
        emit(
            args,
            to_dict(resp).get("endpoints", []),
            ["ID", "POD", "NODE", "IDENTITY", "ADDRESSES", "STATE"],
            [
                [
                    e.id,
                    f"{e.pod_namespace}/{e.pod_name}" if e.pod_name else e.container_id[:12],
                    e.node,
                    e.identity,
                    ",".join(e.addresses),
                    enum_name(endpoint_pb2.EndpointState, e.state, "ENDPOINT_STATE_"),
                ]
                for e in resp.endpoints
            ],
        )
    elif args.action == "get":
        ep = clients.call("endpoint", stub.GetEndpoint, endpoint_pb2.GetEndpointRequest(id=args.id))
        emit(args, to_dict(ep), ["FIELD", "VALUE"], sorted(to_dict(ep).items()))
    elif args.action == "log":
        resp = clients.call(
            "endpoint", stub.GetEndpointLog, endpoint_pb2.GetEndpointLogRequest(id=args.id)
        )
        emit(
            args,
            to_dict(resp).get("entries", []),
            ["TIME", "FROM", "TO", "REASON"],
            [
                [
                    e.time.ToJsonString(),
                    enum_name(endpoint_pb2.EndpointState, e.from_state, "ENDPOINT_STATE_"),
                    enum_name(endpoint_pb2.EndpointState, e.to_state, "ENDPOINT_STATE_"),
                    e.reason,
                ]
                for e in resp.entries
            ],
        )
    return 0


# --- identities, ipcache, policy ---


def label_str(labels: Iterable[policy_pb2.Label]) -> str:
    return ",".join(f"{lb.source}:{lb.key}={lb.value}" for lb in labels)


def parse_labels(specs: Sequence[str]) -> list[policy_pb2.Label]:
    """["app=web", "k8s:tier=db", "reserved:host"] -> labels."""
    out = []
    for spec in specs:
        for item in filter(None, spec.split(",")):
            key, _, value = item.partition("=")
            source, sep, name = key.partition(":")
            if not sep:
                source, name = "k8s", key
            if not name:
                raise CliError(f"label {item!r}: want [source:]key[=value]")
            out.append(policy_pb2.Label(source=source, key=name, value=value))
    return out


def cmd_identity(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.policy()
    if args.action == "list":
        resp = clients.call("policy", stub.ListIdentities, policy_pb2.ListIdentitiesRequest())
        idents = list(resp.identities)
    else:
        idents = [
            clients.call("policy", stub.GetIdentity, policy_pb2.GetIdentityRequest(id=args.id))
        ]
    emit(
        args,
        [to_dict(i) for i in idents],
        ["ID", "LABELS", "REFERENCED BY"],
        [[i.id, label_str(i.labels), ",".join(i.referenced_by)] for i in idents],
    )
    return 0


def cmd_ipcache(args: argparse.Namespace, clients: Clients) -> int:
    resp = clients.call("policy", clients.policy().ListIPCache, policy_pb2.ListIPCacheRequest())
    emit(
        args,
        to_dict(resp).get("entries", []),
        ["PREFIX", "IDENTITY", "NODE", "HOST IP", "SOURCE"],
        [[e.prefix, e.identity, e.node, e.host_ip, e.source] for e in resp.entries],
    )
    return 0


def cmd_policy(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.policy()
    if args.action == "get":
        if args.name:
            rules = [
                clients.call("policy", stub.GetRule, policy_pb2.GetRuleRequest(name=args.name))
            ]
        else:
            rules = list(
                clients.call("policy", stub.ListRules, policy_pb2.ListRulesRequest()).rules
            )
        emit(
            args,
            [to_dict(r) for r in rules],
            ["NAME", "SELECTOR", "INGRESS", "EGRESS", "REVISION"],
            [
                [
                    r.name,
                    json.dumps(to_dict(r.endpoint_selector).get("match_labels", {})),
                    len(r.ingress) + len(r.ingress_deny),
                    len(r.egress) + len(r.egress_deny),
                    r.revision,
                ]
                for r in rules
            ],
        )
    elif args.action == "import":
        try:
            document = Path(args.file).read_text() if args.file != "-" else sys.stdin.read()
        except OSError as exc:
            raise CliError(f"cannot read {args.file}: {exc.strerror}") from None
        resp = clients.call("policy", stub.PutRules, policy_pb2.PutRulesRequest(document=document))
        emit(
            args, to_dict(resp), ["IMPORTED", "REVISION"], [[n, resp.revision] for n in resp.names]
        )
    elif args.action == "delete":
        resp = clients.call("policy", stub.DeleteRule, policy_pb2.DeleteRuleRequest(name=args.name))
        if not resp.deleted:
            raise CliError(f"no rule named {args.name}")
        emit(args, to_dict(resp), ["DELETED", "REVISION"], [[args.name, resp.revision]])
    elif args.action == "trace":
        proto = PROTOCOLS.get(args.proto.lower())
        if proto is None:
            raise CliError(f"unknown protocol {args.proto!r} (tcp, udp, sctp, icmp, any)")
        resp = clients.call(
            "policy",
            stub.TracePolicy,
            policy_pb2.TracePolicyRequest(
                src_labels=parse_labels(args.src),
                dst_labels=parse_labels(args.dst),
                dport=args.dport,
                protocol=policy_pb2.Protocol.ValueType(proto),
            ),
        )
        if args.output == "json":
            print(json.dumps(to_dict(resp), indent=2, sort_keys=True))
        else:
            for line in resp.explanation:
                print(line)
            print(
                f"Final verdict: {enum_name(policy_pb2.Verdict, resp.verdict, 'VERDICT_').upper()}"
            )
    return 0


# --- services, ipam, maps ---


def frontend_str(fe: lb_pb2.Frontend) -> str:
    return f"{fe.address}:{fe.port}/{PROTOCOL_NAMES.get(fe.protocol, '?')}"


def backend_state(state: int) -> str:
    return enum_name(lb_pb2.BackendState, state, "BACKEND_STATE_")


def cmd_service(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.lb()
    if args.action == "list":
        services = list(
            clients.call("lb", stub.ListServices, lb_pb2.ListServicesRequest()).services
        )
    else:
        services = [clients.call("lb", stub.GetService, lb_pb2.GetServiceRequest(name=args.name))]
    emit(
        args,
        [to_dict(s) for s in services],
        ["ID", "NAME", "FRONTEND", "TYPE", "BACKENDS"],
        [
            [
                s.id,
                s.name,
                frontend_str(s.frontend),
                enum_name(lb_pb2.ServiceType, s.type, "SERVICE_TYPE_"),
                ", ".join(f"{b.address}:{b.port} ({backend_state(b.state)})" for b in s.backends),
            ]
            for s in services
        ],
    )
    return 0


def cmd_ipam(args: argparse.Namespace, clients: Clients) -> int:
    resp = clients.call(
        "ipam",
        clients.ipam().ListAllocations,
        ipam_pb2.ListAllocationsRequest(node=args.node or ""),
    )
    emit(
        args,
        to_dict(resp).get("allocations", []),
        ["IP", "NODE", "OWNER", "POD", "EXPIRES"],
        [
            [
                a.ip,
                a.node,
                f"{a.owner.container_id[:12]}/{a.owner.ifname}",
                a.owner.pod,
                a.expires_at.ToJsonString() if a.HasField("expires_at") else "-",
            ]
            for a in resp.allocations
        ],
    )
    return 0


def cmd_map(args: argparse.Namespace, clients: Clients) -> int:
    (dp,) = clients.datapaths(args.node or "", one=True)
    if args.action == "list":
        resp = clients.call_datapath(dp, "ListMaps", datapath_pb2.ListMapsRequest())
        emit(
            args,
            to_dict(resp).get("maps", []),
            ["NAME", "TYPE", "ENTRIES", "MAX", "PENDING", "ERRORS"],
            [[m.name, m.type, m.entries, m.max_entries, m.pending, m.errors] for m in resp.maps],
        )
    else:
        resp = clients.call_datapath(dp, "DumpMap", datapath_pb2.DumpMapRequest(name=args.name))
        emit(
            args,
            to_dict(resp),
            ["KEY", "VALUE"],
            [
                [
                    " ".join(f"{k}={v}" for k, v in sorted(e.key.items())),
                    " ".join(f"{k}={v}" for k, v in sorted(e.value.items())),
                ]
                for e in resp.entries
            ],
        )
    return 0


def flow_line(f: datapath_pb2.Flow) -> str:
    proto = PROTOCOL_NAMES.get(f.protocol, str(f.protocol))
    verdict = enum_name(datapath_pb2.FlowVerdict, f.verdict, "FLOW_VERDICT_").upper()
    direction = enum_name(datapath_pb2.FlowDirection, f.direction, "FLOW_DIRECTION_")
    line = (
        f"{f.time.ToJsonString()} {verdict:<9} {direction:<7} {proto} "
        f"{f.src_ip}:{f.src_port} (id {f.src_identity}) -> {f.dst_ip}:{f.dst_port} "
        f"(id {f.dst_identity}) endpoint {f.endpoint_id}"
    )
    if f.verdict == datapath_pb2.FLOW_VERDICT_DROPPED:
        line += f": {drop_reason_words(f.drop_reason)}"
    return line


def cmd_monitor(args: argparse.Namespace, clients: Clients) -> int:
    verdicts = {
        "forwarded": datapath_pb2.FLOW_VERDICT_FORWARDED,
        "dropped": datapath_pb2.FLOW_VERDICT_DROPPED,
    }
    request = datapath_pb2.ObserveFlowsRequest(
        verdicts=[verdicts[v] for v in args.verdict],
        endpoint_ids=args.endpoint,
        identities=args.identity,
        ip=args.ip or "",
        port=args.port,
        protocol=PROTOCOLS.get((args.proto or "any").lower(), 0),
        last=args.last,
        follow=not args.no_follow,
    )
    targets = clients.datapaths(args.node or "")
    watches = [FlowWatch(clients, dp, request, args) for dp in targets]
    if len(watches) == 1:
        watches[0].run()
    else:
        # One stream per node, merged as the flows come.
        threads = [threading.Thread(target=w.run, daemon=True) for w in watches]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except KeyboardInterrupt:
            for w in watches:
                w.cancel()
    for w in watches:
        if w.error:
            print(f"flagella: {w.error}", file=sys.stderr)
    return 1 if any(w.error for w in watches) else 0


class FlowWatch:
    """One datapath's flow stream, printed line by line."""

    lock = threading.Lock()

    def __init__(
        self,
        clients: Clients,
        dp: Datapath,
        request: datapath_pb2.ObserveFlowsRequest,
        args: argparse.Namespace,
    ) -> None:
        self.dp = dp
        self.args = args
        self.stream = clients.datapath(dp).ObserveFlows(request, timeout=args.duration or None)
        self.error = ""

    def cancel(self) -> None:
        self.stream.cancel()

    def show(self, f: datapath_pb2.Flow) -> str:
        if self.args.output == "json":
            node = {"node": self.dp.node} if self.dp.node else {}
            return json.dumps({**to_dict(f), **node}, sort_keys=True)
        return f"{self.dp.node} {flow_line(f)}" if self.dp.node else flow_line(f)

    def run(self) -> None:
        try:
            for f in self.stream:
                line = self.show(f)
                with self.lock:
                    print(line, flush=True)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return
            where = f"datapath of node {self.dp.node}" if self.dp.node else "datapath service"
            if code == grpc.StatusCode.UNAVAILABLE:
                self.error = f"{where} unreachable at {self.dp.address}"
            else:
                self.error = f"{self.dp.label}: {code.name if code else 'error'}"
        except KeyboardInterrupt:
            self.cancel()


# --- parser ---


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flagella", description="Operate a flagella cluster.")
    for svc in SERVICES:
        default = default_address(svc, os.environ)
        parser.add_argument(
            f"--{svc}-address",
            default=default,
            help=f"{svc} service address (default {default}: FLAGELLA_{svc.upper()}_ADDRESS, "
            "else from a flagella container's environment, else the local port)",
        )
    parser.add_argument(
        "--datapath-address",
        default=default_address("datapath", os.environ),
        help="one datapath's address (default FLAGELLA_DATAPATH_ADDRESS; without it every "
        "node's datapath is found through the node registry, --node to pick one)",
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    certs.add_tls_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    certs.add_parser(sub)

    status = sub.add_parser("status", help="health of every service, map pressure")
    status.add_argument(
        "--wait", type=float, default=0.0, help="retry up to this many seconds until all serve"
    )
    status.add_argument("--brief", action="store_true", help="services only")
    status.add_argument("--node", help="this node's datapath only (default: every node's)")
    status.add_argument(
        "--nodes",
        action="store_true",
        help="each node's view of the others (reachability, latency); datapaths found through "
        "the node registry",
    )
    status.set_defaults(func=cmd_status)

    endpoint = sub.add_parser("endpoint", help="endpoints")
    esub = endpoint.add_subparsers(dest="action", required=True)
    el = esub.add_parser("list")
    el.add_argument("--node")
    el.add_argument("--namespace")
    for name in ("get", "log"):
        esub.add_parser(name).add_argument("id", type=int)
    endpoint.set_defaults(func=cmd_endpoint)

    identity = sub.add_parser("identity", help="security identities")
    isub = identity.add_subparsers(dest="action", required=True)
    isub.add_parser("list")
    isub.add_parser("get").add_argument("id", type=int)
    identity.set_defaults(func=cmd_identity)

    policy = sub.add_parser("policy", help="network policy rules")
    psub = policy.add_subparsers(dest="action", required=True)
    psub.add_parser("get").add_argument("name", nargs="?")
    psub.add_parser("import").add_argument("file", help="YAML or JSON document ('-': stdin)")
    psub.add_parser("delete").add_argument("name")
    trace = psub.add_parser("trace", help="would src reach dst on dport/proto?")
    trace.add_argument("--src", action="append", required=True, help="labels, e.g. app=web")
    trace.add_argument("--dst", action="append", required=True)
    trace.add_argument("--dport", type=int, default=0)
    trace.add_argument("--proto", default="tcp")
    policy.set_defaults(func=cmd_policy)

    ipcache = sub.add_parser("ipcache", help="IP -> identity")
    ipcache.add_subparsers(dest="action", required=True).add_parser("list")
    ipcache.set_defaults(func=cmd_ipcache)

    service = sub.add_parser("service", help="load-balanced services")
    ssub = service.add_subparsers(dest="action", required=True)
    ssub.add_parser("list")
    ssub.add_parser("get").add_argument("name")
    service.set_defaults(func=cmd_service)

    ipam = sub.add_parser("ipam", help="IP allocations")
    ipam_list = ipam.add_subparsers(dest="action", required=True).add_parser("list")
    ipam_list.add_argument("--node")
    ipam.set_defaults(func=cmd_ipam)

    bpf_map = sub.add_parser("map", help="BPF maps of the datapath")
    msub = bpf_map.add_subparsers(dest="action", required=True)
    node_help = "the node whose datapath to read (default: the node this runs on, or the only one)"
    msub.add_parser("list").add_argument("--node", help=node_help)
    dump = msub.add_parser("dump")
    dump.add_argument("name")
    dump.add_argument("--node", help=node_help)
    bpf_map.set_defaults(func=cmd_map)

    monitor = sub.add_parser("monitor", help="live flows (drops and policy verdicts)")
    monitor.add_argument("--verdict", action="append", default=[], choices=("forwarded", "dropped"))
    monitor.add_argument("--endpoint", action="append", type=int, default=[])
    monitor.add_argument("--identity", action="append", type=int, default=[])
    monitor.add_argument("--node", help="this node's flows only (default: every node's)")
    monitor.add_argument("--ip")
    monitor.add_argument("--port", type=int, default=0)
    monitor.add_argument("--proto")
    monitor.add_argument("--last", type=int, default=0, help="first show the last N flows")
    monitor.add_argument("--no-follow", action="store_true", help="only the buffered flows")
    monitor.add_argument("--duration", type=float, default=0, help="stop after N seconds")
    monitor.set_defaults(func=cmd_monitor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clients = Clients(args)
    try:
        return int(args.func(args, clients))
    except (CliError, certs.CertsError) as exc:
        print(f"flagella: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
