"""`flagella bgp`: the nodes' BGP speakers and the peering policies.

- `bgp peers|routes|policies [--node NAME]`: every node's datapath (found
  through the node registry, as `status --nodes`), or one;
- `bgp policy list|put FILE|delete NAME`: the lb's peering policies, put as
  CiliumBGPPeeringPolicy documents (YAML or JSON, Cilium's shape).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.cli.base import Clients, CliError, emit, read_input, to_dict, yaml_documents

TABLES = {
    "": datapath_pb2.GetBgpRoutesRequest.TABLE_UNSPECIFIED,
    "advertised": datapath_pb2.GetBgpRoutesRequest.TABLE_ADVERTISED,
    "received": datapath_pb2.GetBgpRoutesRequest.TABLE_RECEIVED,
    "local": datapath_pb2.GetBgpRoutesRequest.TABLE_LOCAL,
}


def _per_node(
    args: argparse.Namespace, clients: Clients, method: str, request: Any
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(answers by node, the same as dicts, whether every node answered)."""
    answers: dict[str, Any] = {}
    data: dict[str, Any] = {}
    ok = True
    for dp in clients.datapaths(args.node or ""):
        label = dp.node or dp.address
        try:
            answers[label] = clients.call_datapath(dp, method, request)
            data[label] = to_dict(answers[label])
        except CliError as exc:
            data[label] = {"error": str(exc)}
            ok = False
    return answers, data, ok


def _uptime(peer: Any) -> str:
    if not peer.HasField("uptime"):
        return "-"
    s = int(peer.uptime.seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def cmd_peers(args: argparse.Namespace, clients: Clients) -> int:
    answers, data, ok = _per_node(args, clients, "GetBgpPeers", datapath_pb2.GetBgpPeersRequest())
    rows = []
    for node, resp in sorted(answers.items()):
        sp = resp.speaker
        if not resp.peers:
            rows.append(
                [node, "-", "-", sp.local_asn or "-", sp.state, "-", "-", "-", sp.last_error]
            )
        for p in resp.peers:
            rows.append(
                [
                    node,
                    f"{p.peer_address}:{p.peer_port}",
                    p.peer_asn,
                    p.local_asn,
                    p.session_state,
                    _uptime(p),
                    p.prefixes_received,
                    p.prefixes_advertised,
                    p.last_error,
                ]
            )
        for why in sp.not_applied:
            rows.append([node, "-", "-", "-", "not applied", "-", "-", "-", why])
    for node, entry in sorted(data.items()):
        if "error" in entry:
            rows.append([node, "-", "-", "-", "?", "-", "-", "-", entry["error"]])
    headers = ["NODE", "PEER", "ASN", "LOCAL", "STATE", "UPTIME", "RECEIVED", "ADVERTISED", "ERROR"]
    emit(args, data, headers, rows)
    return 0 if ok else 1


def cmd_routes(args: argparse.Namespace, clients: Clients) -> int:
    request = datapath_pb2.GetBgpRoutesRequest(
        table=TABLES[args.table or ""], family=args.family or "", peer_address=args.peer or ""
    )
    answers, data, ok = _per_node(args, clients, "GetBgpRoutes", request)
    rows = [
        [node, r.table, r.peer_address or "-", r.prefix, r.next_hop, " ".join(map(str, r.as_path))]
        for node, resp in sorted(answers.items())
        for r in resp.routes
    ]
    for node, entry in sorted(data.items()):
        if "error" in entry:
            rows.append([node, "?", "-", "-", "-", entry["error"]])
    emit(args, data, ["NODE", "TABLE", "PEER", "PREFIX", "NEXT HOP", "AS PATH"], rows)
    return 0 if ok else 1


def cmd_policies(args: argparse.Namespace, clients: Clients) -> int:
    answers, data, ok = _per_node(
        args, clients, "GetBgpRoutePolicies", datapath_pb2.GetBgpRoutePoliciesRequest()
    )
    rows = [
        [node, p.peer_address, p.direction, ",".join(p.prefixes), p.name]
        for node, resp in sorted(answers.items())
        for p in resp.policies
    ]
    for node, entry in sorted(data.items()):
        if "error" in entry:
            rows.append([node, "-", "?", "-", entry["error"]])
    emit(args, data, ["NODE", "PEER", "DIRECTION", "ACCEPTS", "POLICY"], rows)
    return 0 if ok else 1


def documents(text: str) -> list[str]:
    """Each CiliumBGPPeeringPolicy of a YAML or JSON text, as the JSON the
    lb takes (which checks it and names the field)."""
    return [json.dumps(d) for d in yaml_documents(text)]


def _selector(sel: Any) -> str:
    labels = [f"{k}={v}" for k, v in sorted(sel.match_labels.items())]
    exprs = [f"{e.key} {e.operator} ({','.join(e.values)})" for e in sel.match_expressions]
    return ",".join(labels + exprs) or "(all)"


def cmd_policy(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.lb()
    if args.action == "list":
        resp = clients.call(
            "lb", stub.ListBgpPeeringPolicies, lb_pb2.ListBgpPeeringPoliciesRequest()
        )
        rows = []
        for p in resp.policies:
            nodes = _selector(p.node_selector) if p.HasField("node_selector") else "(all)"
            for vr in p.virtual_routers:
                services = (
                    _selector(vr.service_selector) if vr.HasField("service_selector") else "-"
                )
                peers = ",".join(f"{n.peer_address}/AS{n.peer_asn}" for n in vr.neighbors)
                rows.append(
                    [p.name, nodes, vr.local_asn, vr.export_pod_cidr, services, peers, p.source]
                )
        headers = ["NAME", "NODES", "ASN", "POD CIDR", "SERVICES", "NEIGHBORS", "SOURCE"]
        emit(args, to_dict(resp).get("policies", []), headers, rows)
    elif args.action == "put":
        put = []
        for doc in documents(read_input(args.file)):
            request = lb_pb2.UpsertBgpPeeringPolicyRequest(document=doc)
            put.append(clients.call("lb", stub.UpsertBgpPeeringPolicy, request))
        emit(
            args,
            [to_dict(r) for r in put],
            ["PUT", "CREATED"],
            [[r.policy.name, r.created] for r in put],
        )
    else:
        resp = clients.call(
            "lb",
            stub.DeleteBgpPeeringPolicy,
            lb_pb2.DeleteBgpPeeringPolicyRequest(name=args.name),
        )
        if not resp.deleted:
            raise CliError(f"no BGP peering policy named {args.name}")
        emit(args, to_dict(resp), ["DELETED"], [[args.name]])
    return 0


def add_parser(sub: Any) -> None:
    bgp = sub.add_parser("bgp", help="the nodes' BGP speakers and the BGP peering policies")
    actions = bgp.add_subparsers(dest="bgp_action", required=True)
    node_help = "one node (default: every node of the registry)"
    peers = actions.add_parser("peers", help="each node's BGP sessions")
    peers.add_argument("--node", help=node_help)
    peers.set_defaults(func=cmd_peers)
    routes = actions.add_parser("routes", help="routes advertised and received")
    routes.add_argument("--node", help=node_help)
    routes.add_argument(
        "--table", choices=["advertised", "received", "local"], help="default: advertised+received"
    )
    routes.add_argument("--family", choices=["ipv4", "ipv6"])
    routes.add_argument("--peer", help="one neighbour's address")
    routes.set_defaults(func=cmd_routes)
    policies = actions.add_parser("policies", help="the export policy of each peer")
    policies.add_argument("--node", help=node_help)
    policies.set_defaults(func=cmd_policies)
    policy = actions.add_parser("policy", help="BGP peering policies (CiliumBGPPeeringPolicy)")
    pactions = policy.add_subparsers(dest="action", required=True)
    pactions.add_parser("list")
    pactions.add_parser(
        "put", help="create or replace from a YAML/JSON file (- : stdin)"
    ).add_argument("file")
    pactions.add_parser("delete").add_argument("name")
    policy.set_defaults(func=cmd_policy)
