"""`flagella status`: the health of every service and of every node's
datapath, map pressure, and (--nodes) how the nodes reach each other."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.relay.v1 import relay_pb2
from flagella.cli.base import Clients, CliError, emit
from flagella.cli.targets import SERVICES, Datapath
from flagella.common import mappressure

STATUS_NAMES = {
    health_pb2.HealthCheckResponse.SERVING: "SERVING",
    health_pb2.HealthCheckResponse.NOT_SERVING: "NOT_SERVING",
    health_pb2.HealthCheckResponse.UNKNOWN: "UNKNOWN",
    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: "SERVICE_UNKNOWN",
}


def check_health(
    clients: Clients, address: str, timeout: float, service: str = ""
) -> tuple[str, str]:
    """(status, detail) of one service's gRPC health (of one of its
    replicas when address lists several)."""
    with clients.open(address, service) as channel:
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


def map_pressure(
    clients: Clients, serving: list[Datapath], lockdowns: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Every serving datapath's maps; lockdowns (when given) gets the
    endpoints each one locked down for a policy over its budget."""
    maps: list[dict[str, Any]] = []
    for dp in serving:
        node = {"node": dp.node} if dp.node else {}
        try:
            status = clients.call_datapath(dp, "GetStatus", datapath_pb2.GetStatusRequest())
        except CliError as exc:
            maps.append({**node, "name": "?", "error": str(exc)})
            continue
        maps += [
            {
                **node,
                "name": m.name,
                "entries": m.entries,
                "max_entries": m.max_entries,
                # None: a map that cannot fill up (flagella.common.mappressure).
                "pressure": mappressure.map_pressure(m.type, m.entries, m.max_entries),
            }
            for m in status.maps
        ]
        if lockdowns is not None and status.policy_overflow_endpoints:
            lockdowns.append(
                {
                    **node,
                    "endpoints": list(status.policy_overflow_endpoints),
                    "policy_map_max_entries": status.policy_map_max_entries,
                }
            )
    return maps


RELAY_STATES = {
    relay_pb2.NODE_STATE_CONNECTED: "CONNECTED",
    relay_pb2.NODE_STATE_UNAVAILABLE: "UNAVAILABLE",
    relay_pb2.NODE_STATE_UNSPECIFIED: "UNKNOWN",
}


def relay_status(clients: Clients, timeout: float) -> dict[str, Any]:
    """The flow relay: its health and the nodes it follows, with its view
    of each. Optional, as Hubble Relay is: `observe --node` works without
    it, so it does not make `status` fail."""
    address = clients.args.relay_address
    status, detail = check_health(clients, address, timeout)
    out: dict[str, Any] = {"status": status, "detail": detail, "nodes": {}}
    if status == "SERVING":
        try:
            got = clients.call("relay", clients.relay().GetNodes, relay_pb2.GetNodesRequest())
        except CliError as exc:
            out["detail"] = str(exc)
        else:
            out["nodes"] = {n.name: RELAY_STATES.get(n.state, str(n.state)) for n in got.nodes}
    return out


def cmd_status(args: argparse.Namespace, clients: Clients) -> int:
    if args.nodes:
        return node_health(args, clients)
    deadline = time.monotonic() + args.wait
    while True:
        rows = {
            svc: check_health(clients, getattr(args, f"{svc}_address"), args.timeout, svc)
            for svc in SERVICES
        }
        datapaths, serving = datapath_health(clients, args.node or "", args.timeout)
        rows.update(datapaths)
        healthy = all(status == "SERVING" for status, _ in rows.values())
        if healthy or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    lockdowns: list[dict[str, Any]] = []
    maps = [] if args.brief else map_pressure(clients, serving, lockdowns)
    relay = relay_status(clients, args.timeout)
    data = {
        "services": {svc: {"status": s, "detail": d} for svc, (s, d) in rows.items()},
        "maps": maps,
        "policy_lockdowns": lockdowns,
        "relay": relay,
    }
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        follows = ", ".join(f"{n} {state}" for n, state in sorted(relay["nodes"].items()))
        relay_row = [
            "relay",
            relay["status"],
            relay["detail"] + (f"; nodes: {follows}" if follows else ""),
        ]
        table = [[k, s, d] for k, (s, d) in rows.items()]
        emit(args, data, ["SERVICE", "STATUS", "DETAIL"], [*table, relay_row])
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
                        f"{100 * m['pressure']:.1f}%" if m.get("pressure") is not None else "-",
                    ]
                    for m in maps
                ],
            )
        for lock in lockdowns:
            where = f"node {lock['node']}" if lock.get("node") else "datapath"
            print(
                f"{where}: endpoints locked down (deny all), policy over the policy-map "
                f"budget of {lock['policy_map_max_entries']}: "
                + ", ".join(str(e) for e in lock["endpoints"])
            )
    return 0 if healthy else 1
