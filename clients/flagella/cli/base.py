"""What every command of the CLI shares: its one-line errors, output as a
table or JSON, and the clients of the services (each node's datapath found
through the node registry)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from flagella.api.datapath.v1 import datapath_pb2_grpc
from flagella.api.endpoint.v1 import endpoint_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2_grpc
from flagella.api.relay.v1 import relay_pb2_grpc
from flagella.cli import certs
from flagella.cli.targets import Datapath, default_node, pick_one
from flagella.common import addresses

PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132, "icmp": 1, "icmpv6": 58, "any": 0}
PROTOCOL_NAMES = {v: k.upper() for k, v in PROTOCOLS.items()}


class CliError(Exception):
    """A failure to report as one line, exit status 1."""


def enum_name(enum: Any, value: int, prefix: str) -> str:
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).lower().replace("_", "-")


# --- input ---


def read_input(path: str) -> str:
    """A file's text ("-": stdin's)."""
    try:
        return Path(path).read_text() if path != "-" else sys.stdin.read()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None


def yaml_documents(text: str) -> list[Any]:
    """Each document of a YAML or JSON text (empty ones left out)."""
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise CliError(f"not YAML or JSON: {exc}") from None


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

    def open(self, address: str, service: str = "") -> grpc.Channel:
        """A channel presenting the operator certificate (plaintext with
        --insecure), to one address or a service's replicas (a list or a
        name resolving to each: flagella.common.addresses)."""
        try:
            peer = addresses.target(address, service)
        except ValueError as exc:
            raise CliError(f"--{service or 'datapath'}-address: {exc}") from None
        options = addresses.channel_options(peer)
        if self.args.insecure:
            return grpc.insecure_channel(peer.target, options=options)
        if self._credentials is None:
            try:
                self._credentials = certs.channel_credentials(self.args)
            except certs.CertsError as exc:
                raise CliError(str(exc)) from None
        return grpc.secure_channel(peer.target, self._credentials, options=options)

    def channel(self, address: str, service: str = "") -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = self.open(address, service)
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
        return ipam_pb2_grpc.IpamServiceStub(self.channel(self.args.ipam_address, "ipam"))

    def policy(self) -> Any:
        return policy_pb2_grpc.PolicyServiceStub(self.channel(self.args.policy_address, "policy"))

    def endpoint(self) -> Any:
        return endpoint_pb2_grpc.EndpointServiceStub(
            self.channel(self.args.endpoint_address, "endpoint")
        )

    def lb(self) -> Any:
        return lb_pb2_grpc.LoadBalancerServiceStub(self.channel(self.args.lb_address, "lb"))

    def relay(self) -> Any:
        return relay_pb2_grpc.RelayServiceStub(self.channel(self.args.relay_address, "relay"))

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
