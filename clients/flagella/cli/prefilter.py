"""`flagella prefilter list|add|delete`: the XDP prefilter of a node's
datapath (source CIDRs dropped before the stack), as `cilium prefilter`.

add and delete send the revision given with --revision, else the one a
GetPrefilter just read: a change made in between is refused, not
overwritten."""

from __future__ import annotations

import argparse
from typing import Any

from google.protobuf.message import Message

from flagella.api.datapath.v1 import datapath_pb2
from flagella.cli.base import Clients, emit, to_dict


def cmd_prefilter(args: argparse.Namespace, clients: Clients) -> int:
    (dp,) = clients.datapaths(args.node or "", one=True)
    if args.action == "list":
        resp = clients.call_datapath(dp, "GetPrefilter", datapath_pb2.GetPrefilterRequest())
    else:
        revision = args.revision
        if revision is None:
            got = clients.call_datapath(dp, "GetPrefilter", datapath_pb2.GetPrefilterRequest())
            revision = got.revision
        change: Message
        if args.action == "add":
            method = "PatchPrefilter"
            change = datapath_pb2.PatchPrefilterRequest(cidrs=args.cidrs, revision=revision)
        else:
            method = "DeletePrefilter"
            change = datapath_pb2.DeletePrefilterRequest(cidrs=args.cidrs, revision=revision)
        resp = clients.call_datapath(dp, method, change)
    modes = ",".join(f"{d.name}:{d.mode if d.attached else 'detached'}" for d in resp.devices)
    emit(
        args,
        to_dict(resp),
        ["CIDR", "DROPPED", "BYTES", "REVISION", "DEVICES"],
        [
            [e.cidr, e.dropped_packets, e.dropped_bytes, resp.revision, modes or "-"]
            for e in resp.entries
        ],
    )
    return 0


def add_parser(sub: Any) -> None:
    prefilter = sub.add_parser("prefilter", help="the XDP prefilter: source CIDRs dropped early")
    actions = prefilter.add_subparsers(dest="action", required=True)
    node_help = "the node whose datapath to use (default: the node this runs on, or the only one)"
    actions.add_parser("list").add_argument("--node", help=node_help)
    for name in ("add", "delete"):
        action = actions.add_parser(name)
        action.add_argument("cidrs", nargs="+", metavar="CIDR")
        action.add_argument("--node", help=node_help)
        action.add_argument("--revision", type=int, help="the revision read (default: read it now)")
    prefilter.set_defaults(func=cmd_prefilter)
