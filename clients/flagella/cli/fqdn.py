"""`flagella fqdn`: the FQDN cache (what names resolved to for each
endpoint, as its node's DNS proxy saw the answers) and the toFQDNs
selectors in use, as `cilium fqdn cache list|clean` and `cilium fqdn names`."""

from __future__ import annotations

import argparse
from typing import Any

from flagella.api.policy.v1 import policy_pb2
from flagella.cli.base import Clients, CliError, emit, to_dict


def cmd_fqdn(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.policy()
    if args.what == "names":
        resp = clients.call("policy", stub.ListFQDNSelectors, policy_pb2.ListFQDNSelectorsRequest())
        emit(
            args,
            to_dict(resp).get("selections", []),
            ["SELECTOR", "NAMES", "IPS", "IDENTITIES", "RULES"],
            [
                [
                    s.selector.match_name or s.selector.match_pattern,
                    ",".join(n.name for n in s.names) or "-",
                    ",".join(ip for n in s.names for ip in n.ips) or "-",
                    ",".join(map(str, s.identities)) or "-",
                    ",".join(s.rules),
                ]
                for s in resp.selections
            ],
        )
        return 0
    if args.action == "list":
        resp = clients.call(
            "policy",
            stub.ListFQDNCache,
            policy_pb2.ListFQDNCacheRequest(
                node=args.node or "",
                endpoint=args.endpoint or "",
                match_pattern=args.match_pattern or "",
                cidr=args.cidr or "",
            ),
        )
        emit(
            args,
            to_dict(resp).get("entries", []),
            ["NODE", "ENDPOINT", "NAME", "IPS", "TTL", "EXPIRES"],
            [
                [e.node, e.endpoint, e.name, ",".join(e.ips), e.ttl, e.expires.ToJsonString()]
                for e in resp.entries
            ],
        )
        return 0
    if not (args.node or args.match_pattern):
        raise CliError('give --node or --match-pattern ("*" for every name)')
    resp = clients.call(
        "policy",
        stub.DeleteFQDNCache,
        policy_pb2.DeleteFQDNCacheRequest(
            node=args.node or "",
            endpoint=args.endpoint or "",
            match_pattern=args.match_pattern or "",
        ),
    )
    emit(args, to_dict(resp), ["DELETED", "REVISION"], [[resp.deleted, resp.revision]])
    return 0


def add_parser(sub: Any) -> None:
    fqdn = sub.add_parser("fqdn", help="DNS-aware policy: the FQDN cache and selectors")
    what = fqdn.add_subparsers(dest="what", required=True)
    what.add_parser("names", help="toFQDNs selectors in use and what they select")
    cache = what.add_parser("cache", help="what names resolved to, per endpoint")
    actions = cache.add_subparsers(dest="action", required=True)
    for name in ("list", "delete"):
        action = actions.add_parser(name)
        action.add_argument("--node")
        action.add_argument("--endpoint")
        action.add_argument("--match-pattern", help='a name or a pattern ("*.example.com")')
        if name == "list":
            action.add_argument("--cidr", help="entries with an address inside this CIDR")
    fqdn.set_defaults(func=cmd_fqdn)
