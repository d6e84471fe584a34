"""`flagella lb-pool`: LB-IPAM's address pools (as CiliumLoadBalancerIPPool),
what LoadBalancer services get their external addresses from."""

from __future__ import annotations

import argparse
from typing import Any

from flagella.api.lb.v1 import lb_pb2
from flagella.cli.base import Clients, CliError, emit, to_dict


def block(text: str) -> lb_pb2.LbIpBlock:
    """A CIDR, or start-stop."""
    start, sep, stop = text.partition("-")
    return lb_pb2.LbIpBlock(start=start, stop=stop) if sep else lb_pb2.LbIpBlock(cidr=text)


def block_text(b: lb_pb2.LbIpBlock) -> str:
    return b.cidr or f"{b.start}-{b.stop}"


def cmd_lb_pool(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.lb()
    if args.action == "list":
        resp = clients.call("lb", stub.ListLbIpPools, lb_pb2.ListLbIpPoolsRequest())
        emit(
            args,
            to_dict(resp).get("pools", []),
            ["NAME", "SOURCE", "BLOCKS", "SELECTOR", "DISABLED", "USED", "CONFLICT"],
            [
                [
                    p.name,
                    p.source,
                    ",".join(block_text(b) for b in p.blocks),
                    ",".join(f"{k}={v}" for k, v in sorted(p.service_selector.items())) or "-",
                    str(p.disabled).lower(),
                    f"{p.used}/{p.size}",
                    p.conflict_message or "-",
                ]
                for p in resp.pools
            ],
        )
    elif args.action == "put":
        selector = {}
        for item in args.selector or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise CliError(f"--selector {item!r}: want key=value")
            selector[key] = value
        pool = lb_pb2.LbIpPool(
            name=args.name,
            blocks=[block(b) for b in args.blocks],
            service_selector=selector,
            disabled=args.disabled,
        )
        put = clients.call("lb", stub.UpsertLbIpPool, lb_pb2.UpsertLbIpPoolRequest(pool=pool))
        emit(
            args,
            to_dict(put),
            ["PUT", "CREATED", "USED"],
            [[args.name, put.created, put.pool.used]],
        )
    else:
        resp = clients.call("lb", stub.DeleteLbIpPool, lb_pb2.DeleteLbIpPoolRequest(name=args.name))
        if not resp.deleted:
            raise CliError(f"no LB-IPAM pool named {args.name}")
        emit(args, to_dict(resp), ["DELETED"], [[args.name]])
    return 0


def add_parser(sub: Any) -> None:
    pool = sub.add_parser("lb-pool", help="LB-IPAM address pools of LoadBalancer services")
    actions = pool.add_subparsers(dest="action", required=True)
    actions.add_parser("list")
    put = actions.add_parser("put", help="create or replace a pool")
    put.add_argument("name")
    put.add_argument("blocks", nargs="+", help="CIDRs or start-stop ranges")
    put.add_argument(
        "--selector",
        action="append",
        help="key=value a service must have (io.kubernetes.service.namespace=NS: its namespace)",
    )
    put.add_argument("--disabled", action="store_true", help="assign no more addresses from it")
    actions.add_parser("delete").add_argument("name")
    pool.set_defaults(func=cmd_lb_pool)
