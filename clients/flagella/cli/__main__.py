"""flagella: the operator CLI.

Service addresses come from flags or FLAGELLA_<SVC>_ADDRESS (defaults: the
local bring-up's ports).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_ADDRESSES = {
    "ipam": "127.0.0.1:50051",
    "policy": "127.0.0.1:50052",
    "endpoint": "127.0.0.1:50053",
    "lb": "127.0.0.1:50054",
    "datapath": "127.0.0.1:50055",
}
STATUS_NAMES = {
    health_pb2.HealthCheckResponse.SERVING: "SERVING",
    health_pb2.HealthCheckResponse.NOT_SERVING: "NOT_SERVING",
    health_pb2.HealthCheckResponse.UNKNOWN: "UNKNOWN",
    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: "SERVICE_UNKNOWN",
}


def check_health(address: str, timeout: float) -> tuple[str, str]:
    """(status, detail) of one service's gRPC health."""
    with grpc.insecure_channel(address) as channel:
        # The health stub's type stubs lack its methods.
        stub: Any = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return "DOWN", f"{code.name if code else 'error'}: unreachable at {address}"
        return STATUS_NAMES.get(resp.status, str(resp.status)), address


def cmd_status(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    while True:
        rows = {
            svc: check_health(getattr(args, f"{svc}_address"), args.timeout)
            for svc in DEFAULT_ADDRESSES
        }
        healthy = all(status == "SERVING" for status, _ in rows.values())
        if healthy or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if args.output == "json":
        print(
            json.dumps({svc: {"status": s, "detail": d} for svc, (s, d) in rows.items()}, indent=2)
        )
    else:
        print(f"{'SERVICE':<10} {'STATUS':<12} DETAIL")
        for svc, (status, detail) in rows.items():
            print(f"{svc:<10} {status:<12} {detail}")
    return 0 if healthy else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flagella", description="Operate a flagella cluster.")
    for svc, default in DEFAULT_ADDRESSES.items():
        parser.add_argument(
            f"--{svc}-address",
            default=os.environ.get(f"FLAGELLA_{svc.upper()}_ADDRESS", default),
            help=f"{svc} service address (default {default})",
        )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per call")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="health of every service")
    status.add_argument(
        "--wait", type=float, default=0.0, help="retry up to this many seconds until all serve"
    )
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
