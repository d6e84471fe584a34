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
from collections.abc import Iterable, Sequence

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.cli import bgp, certs, config, debug, etcdauth, fqdn, lbpool, lrp, prefilter
from flagella.cli.base import (
    PROTOCOL_NAMES,
    PROTOCOLS,
    Clients,
    CliError,
    emit,
    enum_name,
    read_input,
    to_dict,
)
from flagella.cli.observe import cmd_monitor, cmd_observe
from flagella.cli.status import cmd_status
from flagella.cli.targets import SERVICES, default_address

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
        fields = {**to_dict(ep), **datapath_policy_map(clients, ep)}
        emit(args, fields, ["FIELD", "VALUE"], sorted(fields.items()))
    elif args.action in ("config", "labels"):
        return config.cmd_endpoint(args, clients)
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


def datapath_policy_map(clients: Clients, ep: endpoint_pb2.Endpoint) -> dict[str, object]:
    """The endpoint's policy-map use on its node, and whether the datapath
    locked it down (policy over budget); the datapath's error if it did not
    answer."""
    if not ep.node:
        return {}
    try:
        # --datapath-address names the datapath itself (no --node with it).
        [dp] = clients.datapaths("" if clients.args.datapath_address else ep.node)
        got = clients.call_datapath(
            dp, "GetEndpoint", datapath_pb2.GetEndpointRequest(endpoint_id=ep.id)
        )
    except CliError as exc:
        return {"policy_map": f"unknown: {exc}"}
    return {
        "policy_map_entries": got.policy_map_entries,
        "policy_overflow": got.policy_overflow or "none",
    }


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
    if args.action == "endpoints":
        uses = clients.call(
            "policy",
            stub.GetIdentityEndpoints,
            policy_pb2.GetIdentityEndpointsRequest(node=args.node or ""),
        )
        emit(
            args,
            to_dict(uses).get("identities", []),
            ["ID", "NODE", "REFS", "OWNERS", "LABELS"],
            [
                [u.identity, u.node, u.ref_count, ",".join(u.owners) or "-", label_str(u.labels)]
                for u in uses.identities
            ],
        )
        return 0
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
        document = read_input(args.file)
        resp = clients.call("policy", stub.PutRules, policy_pb2.PutRulesRequest(document=document))
        for warning in resp.warnings:  # accepted, but read differently (stderr: not the table)
            print(f"warning: {warning}", file=sys.stderr)
        emit(
            args, to_dict(resp), ["IMPORTED", "REVISION"], [[n, resp.revision] for n in resp.names]
        )
    elif args.action == "delete":
        resp = clients.call("policy", stub.DeleteRule, policy_pb2.DeleteRuleRequest(name=args.name))
        if not resp.deleted:
            raise CliError(f"no rule named {args.name}")
        emit(args, to_dict(resp), ["DELETED", "REVISION"], [[args.name, resp.revision]])
    elif args.action == "selectors":
        sels = clients.call(
            "policy", stub.GetPolicySelectors, policy_pb2.GetPolicySelectorsRequest()
        )
        emit(
            args,
            to_dict(sels).get("selectors", []),
            ["SELECTOR", "ROLE", "IDENTITIES", "RULES"],
            [
                [s.selector, s.role, ",".join(map(str, s.identities)) or "-", ",".join(s.rules)]
                for s in sels.selectors
            ],
        )
    elif args.action == "trace":
        proto = PROTOCOLS.get(args.proto.lower())
        if proto is None:
            raise CliError(f"unknown protocol {args.proto!r} (tcp, udp, sctp, icmp, icmpv6, any)")
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


def cmd_cidrgroup(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.policy()
    if args.action == "list":
        resp = clients.call("policy", stub.ListCIDRGroups, policy_pb2.ListCIDRGroupsRequest())
        emit(
            args,
            to_dict(resp).get("groups", []),
            ["NAME", "CIDRS", "SOURCE", "REVISION"],
            [
                [g.name, ",".join(g.cidrs) or "-", g.source.kind or "api", g.revision]
                for g in resp.groups
            ],
        )
    elif args.action == "put":
        group = policy_pb2.CIDRGroup(name=args.name, cidrs=args.cidrs)
        put = clients.call("policy", stub.PutCIDRGroup, group)
        emit(args, to_dict(put), ["PUT", "REVISION"], [[args.name, put.revision]])
    else:
        resp = clients.call(
            "policy", stub.DeleteCIDRGroup, policy_pb2.DeleteCIDRGroupRequest(name=args.name)
        )
        if not resp.deleted:
            raise CliError(f"no CIDR group named {args.name}")
        emit(args, to_dict(resp), ["DELETED", "REVISION"], [[args.name, resp.revision]])
    return 0


# --- services, ipam, maps ---


def frontend_str(fe: lb_pb2.Frontend) -> str:
    return f"{fe.address}:{fe.port}/{PROTOCOL_NAMES.get(fe.protocol, '?')}"


def backend_state(state: int) -> str:
    return enum_name(lb_pb2.BackendState, state, "BACKEND_STATE_")


def external_str(s: lb_pb2.Service) -> str:
    """A LoadBalancer service's addresses (or why it has none), then its
    external IPs."""
    parts: list[str] = []
    if s.HasField("load_balancer"):
        lb = s.load_balancer
        parts.append(",".join(lb.ingress) or f"<pending: {lb.condition.reason}>")
    parts += list(s.external_ips)
    return ",".join(parts) or "-"


def traffic_policy_str(s: lb_pb2.Service) -> str:
    """externalTrafficPolicy, as Kubernetes spells it."""
    return enum_name(lb_pb2.TrafficPolicy, s.external_traffic_policy, "TRAFFIC_POLICY_").title()


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
        ["ID", "NAME", "FRONTEND", "TYPE", "EXTERNAL", "ETP", "BACKENDS"],
        [
            [
                s.id,
                s.name,
                frontend_str(s.frontend),
                enum_name(lb_pb2.ServiceType, s.type, "SERVICE_TYPE_"),
                external_str(s),
                traffic_policy_str(s),
                ", ".join(f"{b.address}:{b.port} ({backend_state(b.state)})" for b in s.backends),
            ]
            for s in services
        ],
    )
    return 0


def cmd_ipam(args: argparse.Namespace, clients: Clients) -> int:
    if args.action == "node-ids":
        ids = clients.call("ipam", clients.ipam().GetNodeIds, ipam_pb2.GetNodeIdsRequest())
        emit(
            args,
            to_dict(ids).get("ids", []),
            ["ID", "NODE", "IPS"],
            [[x.id, x.node, ",".join(x.ips) or "-"] for x in ids.ids],
        )
        return 0
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
    if args.action == "events":
        return debug.cmd_map_events(args, clients)
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
    relay = default_address("relay", os.environ)
    parser.add_argument(
        "--relay-address",
        default=relay,
        help=f"the flow relay, which observe asks (default {relay}: FLAGELLA_RELAY_ADDRESS, "
        "else from a flagella container's environment, else the local port)",
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    certs.add_tls_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    certs.add_parser(sub)
    etcdauth.add_parser(sub)

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
    config.add_endpoint_parsers(esub)
    endpoint.set_defaults(func=cmd_endpoint)

    identity = sub.add_parser("identity", help="security identities")
    isub = identity.add_subparsers(dest="action", required=True)
    isub.add_parser("list")
    isub.add_parser("get").add_argument("id", type=int)
    isub.add_parser("endpoints", help="identities referenced per node").add_argument("--node")
    identity.set_defaults(func=cmd_identity)

    policy = sub.add_parser("policy", help="network policy rules")
    psub = policy.add_subparsers(dest="action", required=True)
    psub.add_parser("get").add_argument("name", nargs="?")
    psub.add_parser("import").add_argument("file", help="YAML or JSON document ('-': stdin)")
    psub.add_parser("delete").add_argument("name")
    psub.add_parser("selectors", help="selectors in use: what each selects, which rules")
    trace = psub.add_parser("trace", help="would src reach dst on dport/proto?")
    trace.add_argument("--src", action="append", required=True, help="labels, e.g. app=web")
    trace.add_argument("--dst", action="append", required=True)
    trace.add_argument("--dport", type=int, default=0, help="destination port (ICMP: the type)")
    trace.add_argument("--proto", default="tcp")
    policy.set_defaults(func=cmd_policy)

    cidrgroup = sub.add_parser("cidrgroup", help="CIDR groups rules name (cidrGroupRef)")
    gsub = cidrgroup.add_subparsers(dest="action", required=True)
    gsub.add_parser("list")
    put = gsub.add_parser("put", help="create or replace a group")
    put.add_argument("name")
    put.add_argument("cidrs", nargs="*", help="CIDRs or addresses (none: an empty group)")
    gsub.add_parser("delete").add_argument("name")
    cidrgroup.set_defaults(func=cmd_cidrgroup)

    ipcache = sub.add_parser("ipcache", help="IP -> identity")
    ipcache.add_subparsers(dest="action", required=True).add_parser("list")
    ipcache.set_defaults(func=cmd_ipcache)

    fqdn.add_parser(sub)
    config.add_parser(sub)

    service = sub.add_parser("service", help="load-balanced services")
    ssub = service.add_subparsers(dest="action", required=True)
    ssub.add_parser("list")
    ssub.add_parser("get").add_argument("name")
    service.set_defaults(func=cmd_service)
    lbpool.add_parser(sub)

    lrp.add_parser(sub)
    bgp.add_parser(sub)

    ipam = sub.add_parser("ipam", help="IP allocations")
    ipam_actions = ipam.add_subparsers(dest="action", required=True)
    ipam_actions.add_parser("list").add_argument("--node")
    ipam_actions.add_parser("node-ids", help="node ids with their nodes' addresses")
    ipam.set_defaults(func=cmd_ipam)

    bpf_map = sub.add_parser("map", help="BPF maps of the datapath")
    msub = bpf_map.add_subparsers(dest="action", required=True)
    node_help = "the node whose datapath to read (default: the node this runs on, or the only one)"
    msub.add_parser("list").add_argument("--node", help=node_help)
    dump = msub.add_parser("dump")
    dump.add_argument("name")
    dump.add_argument("--node", help=node_help)
    bpf_map.set_defaults(func=cmd_map)
    debug.add_parsers(sub, msub, node_help)

    monitor = sub.add_parser(
        "monitor", help="live flows, as before observe (JSON: the datapath's Flow message)"
    )
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

    observe = sub.add_parser(
        "observe",
        help="flows as hubble observe shows them (-o json: one Hubble flow per line)",
        description="Flows of every node through the relay (--node or --datapath-address: "
        "from those datapaths directly), each end named. "
        "Without --last, --since or --follow: the last 20. Filters on pods, namespaces "
        "and labels match when the source or the destination matches all of them.",
    )
    observe.add_argument("-o", "--output", choices=("table", "json"), default=argparse.SUPPRESS)
    observe.add_argument(
        "--pod", action="append", default=[], help="[namespace/]pod-name-prefix, either end"
    )
    observe.add_argument("-n", "--namespace", action="append", default=[], help="either end")
    observe.add_argument(
        "-l", "--label", action="append", default=[], help="selector, e.g. app=db,tier!=web"
    )
    observe.add_argument("--identity", action="append", type=int, default=[])
    observe.add_argument(
        "--verdict",
        action="append",
        default=[],
        type=str.upper,
        choices=("FORWARDED", "DROPPED", "AUDIT"),
    )
    observe.add_argument(
        "--drop-reason", action="append", default=[], help="a number or a name (POLICY_DENIED)"
    )
    observe.add_argument(
        "--traffic-direction", action="append", default=[], type=str.upper,
        choices=("INGRESS", "EGRESS"),
    )  # fmt: skip
    observe.add_argument("--port", type=int, default=0, help="source or destination port")
    observe.add_argument("--protocol", help="tcp, udp, sctp, icmp, icmpv6")
    observe.add_argument("--node", action="append", default=[], help="node name (globs)")
    observe.add_argument("--since", help="a duration back (5m, 1h30m) or an RFC 3339 time")
    observe.add_argument("--last", type=int, default=0, help="the last N buffered flows")
    observe.add_argument("-f", "--follow", action="store_true", help="keep showing new flows")
    observe.add_argument("--duration", type=float, default=0, help="stop after N seconds")
    observe.set_defaults(func=cmd_observe)
    prefilter.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clients = Clients(args)
    try:
        return int(args.func(args, clients))
    except (CliError, certs.CertsError) as exc:
        print(f"flagella: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`flagella monitor | head`): end quietly, as
        # other command-line tools do. Python would otherwise complain again
        # when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for such a tool


if __name__ == "__main__":
    sys.exit(main())
