"""`flagella config get|patch`: the runtime configuration (as `cilium config`),
cluster-wide or one node's overrides, applied by every datapath live; and
`flagella endpoint config|labels`: one endpoint's options and its labels by
source (as `cilium endpoint config` and `cilium endpoint labels`)."""

from __future__ import annotations

import argparse
from typing import Any

from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.cli.base import Clients, CliError, emit, to_dict


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CliError(f"{item!r}: give KEY=VALUE")
        out[key] = value
    return out


def cmd_config(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.policy()
    node = args.node or ""
    if args.action == "get":
        resp = clients.call("policy", stub.GetConfig, policy_pb2.GetConfigRequest(node=node))
    else:
        values = _pairs(args.values)
        if not values and not args.reset:
            raise CliError("give KEY=VALUE or --reset KEY")
        resp = clients.call(
            "policy",
            stub.PatchConfig,
            policy_pb2.PatchConfigRequest(
                node=node,
                set=values,
                reset=args.reset,
                expected_revision=args.expected_revision,
            ),
        )
    emit(
        args,
        to_dict(resp),
        ["OPTION", "VALUE", "SOURCE", "DEFAULT", "MUTABLE"],
        [
            [o.name, o.value or "-", o.source or "-", o.default or "-", o.mutable]
            for o in resp.options
        ],
    )
    if args.output != "json":
        revision = resp.node_revision if node else resp.cluster_revision
        print(f"revision {revision}")
    return 0


def add_parser(sub: Any) -> None:
    config = sub.add_parser("config", help="runtime configuration (every datapath, live)")
    actions = config.add_subparsers(dest="action", required=True)
    node_help = "a node's overrides (default: the cluster's values)"
    actions.add_parser("get").add_argument("--node", help=node_help)
    patch = actions.add_parser("patch", help="set KEY=VALUE (mutable options only)")
    patch.add_argument("values", nargs="*", metavar="KEY=VALUE")
    patch.add_argument("--node", help=node_help)
    patch.add_argument("--reset", action="append", default=[], metavar="KEY", help="unset")
    patch.add_argument(
        "--expected-revision", type=int, default=0, help="refused unless still at it"
    )
    config.set_defaults(func=cmd_config)


def cmd_endpoint(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.endpoint()
    if args.action == "config":
        values = _pairs(args.values)
        if values or args.reset:
            request = endpoint_pb2.PatchEndpointConfigRequest(
                id=args.id, set=values, reset=args.reset
            )
            cfg = clients.call("endpoint", stub.PatchEndpointConfig, request)
        else:
            get = endpoint_pb2.GetEndpointConfigRequest(id=args.id)
            cfg = clients.call("endpoint", stub.GetEndpointConfig, get)
        emit(
            args,
            to_dict(cfg),
            ["OPTION", "VALUE", "TAKES"],
            [[name, cfg.options.get(name, "-"), cfg.allowed[name]] for name in sorted(cfg.allowed)],
        )
        return 0
    if args.add or args.delete or args.disable or args.enable:
        clients.call(
            "endpoint",
            stub.PatchEndpointLabels,
            endpoint_pb2.PatchEndpointLabelsRequest(
                id=args.id,
                add_custom=_pairs(args.add),
                delete_custom=args.delete,
                disable=args.disable,
                enable=args.enable,
            ),
        )
    labels = clients.call(
        "endpoint", stub.GetEndpointLabels, endpoint_pb2.GetEndpointLabelsRequest(id=args.id)
    )
    rows = [
        [f"{lb.source}:{lb.key}={lb.value}", kind]
        for kind, group in (
            ("orchestration-identity", labels.orchestration_identity),
            ("orchestration-info", labels.orchestration_info),
            ("custom", labels.custom),
            ("disabled", labels.disabled),
        )
        for lb in group
    ]
    emit(args, to_dict(labels), ["LABEL", "SOURCE"], rows)
    return 0


def add_endpoint_parsers(esub: Any) -> None:
    config = esub.add_parser("config", help="an endpoint's options: KEY=VALUE sets them")
    config.add_argument("id", type=int)
    config.add_argument("values", nargs="*", metavar="KEY=VALUE")
    config.add_argument("--reset", action="append", default=[], metavar="KEY")
    labels = esub.add_parser("labels", help="an endpoint's labels by source")
    labels.add_argument("id", type=int)
    labels.add_argument("--add", action="append", default=[], metavar="[SOURCE:]KEY=VALUE")
    labels.add_argument("--delete", action="append", default=[], metavar="[SOURCE:]KEY")
    labels.add_argument("--disable", action="append", default=[], metavar="KEY")
    labels.add_argument("--enable", action="append", default=[], metavar="KEY")
