"""Commands for bug reports and deep looks: `flagella map events` (the
writes a datapath made to a map), `flagella debuginfo` (every service's
part in one JSON document) and `flagella cgroups` (the pods of a node with
their cgroups)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.cli.base import Clients, CliError, emit, enum_name, to_dict
from flagella.cli.observe import printing
from flagella.common import debuginfo

# --- flagella map events ---


def event_line(e: datapath_pb2.MapEvent) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(e.time.seconds))
    action = enum_name(datapath_pb2.MapEventAction, e.action, "MAP_EVENT_ACTION_")
    outcome = "ok" if e.outcome == datapath_pb2.MAP_EVENT_OUTCOME_OK else f"error {e.error}"
    if e.outcome == datapath_pb2.MAP_EVENT_OUTCOME_OK and e.errno:
        outcome = f"ok ({e.error})"
    key = " ".join(f"{k}={v}" for k, v in sorted(e.key.items()))
    value = " ".join(f"{k}={v}" for k, v in sorted(e.value.items()))
    when += f".{e.time.nanos // 1_000_000:03d}"
    return f"{e.seq:>8} {when} {action:<6} {outcome:<8} {key}  {value}".rstrip()


def cmd_map_events(args: argparse.Namespace, clients: Clients) -> int:
    (dp,) = clients.datapaths(args.node or "", one=True)
    request = datapath_pb2.GetMapEventsRequest(name=args.name, follow=args.follow)
    timeout = (args.duration or None) if args.follow else args.timeout
    stream = clients.datapath(dp).GetMapEvents(request, timeout=timeout)

    def lines() -> Any:
        if args.output != "json":
            yield f"{'SEQ':>8} {'TIME':<12} {'ACTION':<6} {'OUTCOME':<8} KEY  VALUE"
        try:
            for e in stream:
                yield (
                    json.dumps(to_dict(e), sort_keys=True)
                    if args.output == "json"
                    else event_line(e)
                )
        except grpc.RpcError as exc:
            if args.follow and args.duration and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return  # --duration is over
            where = f"datapath of node {dp.node}" if dp.node else "datapath service"
            raise CliError(f"{where} ({dp.address}): {exc.code().name}: {exc.details()}") from None

    try:
        printing(lines())
    finally:
        stream.cancel()
    return 0


# --- flagella debuginfo ---


def cmd_debuginfo(args: argparse.Namespace, clients: Clients) -> int:
    """Every service's GetDebuginfo, and every node's datapath's, in one
    document; a part that cannot be had is named under "errors" (exit 1),
    the rest is still written."""
    doc: dict[str, Any] = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cli": {"versions": debuginfo.versions("cli")},
        "services": {},
        "nodes": {},
        "errors": {},
    }
    parts: dict[str, Callable[[], Any]] = {
        "ipam": lambda: clients.call(
            "ipam", clients.ipam().GetDebuginfo, ipam_pb2.GetDebuginfoRequest()
        ),
        "policy": lambda: clients.call(
            "policy", clients.policy().GetDebuginfo, policy_pb2.GetDebuginfoRequest()
        ),
        "endpoint": lambda: clients.call(
            "endpoint", clients.endpoint().GetDebuginfo, endpoint_pb2.GetDebuginfoRequest()
        ),
        "lb": lambda: clients.call("lb", clients.lb().GetDebuginfo, lb_pb2.GetDebuginfoRequest()),
        "relay": lambda: clients.call(
            "relay", clients.relay().GetDebuginfo, datapath_pb2.GetDebuginfoRequest()
        ),
    }
    for name, get in parts.items():
        try:
            doc["services"][name] = to_dict(get())
        except CliError as exc:
            doc["errors"][name] = str(exc)
    try:
        datapaths = clients.datapaths(args.node or "")
    except CliError as exc:
        datapaths = []
        doc["errors"]["datapaths"] = str(exc)
    for dp in datapaths:
        try:
            got = to_dict(
                clients.call_datapath(dp, "GetDebuginfo", datapath_pb2.GetDebuginfoRequest())
            )
        except CliError as exc:
            doc["errors"][f"datapath {dp.node or dp.address}"] = str(exc)
            continue
        # Under its node's name (as the datapath reports it when given by address).
        node = dp.node or got.get("state", {}).get("status", {}).get("node", dp.address)
        doc["nodes"][node] = got
    print(json.dumps(doc, indent=2, sort_keys=True))
    for what, error in doc["errors"].items():
        print(f"flagella: debuginfo: {what}: {error}", file=sys.stderr)
    return 1 if doc["errors"] else 0


# --- flagella cgroups ---


def cmd_cgroups(args: argparse.Namespace, clients: Clients) -> int:
    (dp,) = clients.datapaths(args.node or "", one=True)
    resp = clients.call_datapath(
        dp, "GetCgroupDumpMetadata", datapath_pb2.GetCgroupDumpMetadataRequest()
    )
    rows = []
    for p in resp.pods:
        for c in p.containers:
            rows.append([p.endpoint_id, p.container_id, c.cgroup_id, c.cgroup_path, len(c.pids)])
        if not p.containers:
            rows.append([p.endpoint_id, p.container_id, "-", f"({p.error})", 0])
    emit(args, to_dict(resp), ["ENDPOINT", "CONTAINER", "CGROUP-ID", "PATH", "PIDS"], rows)
    return 0


def add_parsers(sub: Any, map_actions: Any, node_help: str) -> None:
    """`map events` under `map` (cmd_map runs it), `debuginfo` and `cgroups`."""
    events = map_actions.add_parser(
        "events", help="the writes the datapath made to a map (its history, then --follow)"
    )
    events.add_argument("name")
    events.add_argument("--node", help=node_help)
    events.add_argument("-f", "--follow", action="store_true", help="keep showing new writes")
    events.add_argument("--duration", type=float, default=0, help="with --follow: stop after N s")
    info = sub.add_parser(
        "debuginfo",
        help="every service's configuration (secrets left out), versions, state and recent "
        "errors, and every node's datapath's, as one JSON document",
    )
    info.add_argument("--node", help="this node's datapath only (default: every node's)")
    info.set_defaults(func=cmd_debuginfo)
    cg = sub.add_parser("cgroups", help="the pods of a node with their cgroup ids and paths")
    cg.add_argument("--node", help=node_help)
    cg.set_defaults(func=cmd_cgroups)
