"""`flagella monitor`: flows from every node's datapath (or one), merged as
they come."""

from __future__ import annotations

import argparse
import json
import sys
import threading

import grpc

from flagella.api.datapath.v1 import datapath_pb2
from flagella.cli.base import PROTOCOL_NAMES, PROTOCOLS, Clients, enum_name, to_dict
from flagella.cli.targets import Datapath


def drop_reason_words(code: int) -> str:
    """A drop reason in words, e.g. "policy denied (L3)"."""
    words: dict[int, str] = {
        datapath_pb2.DROP_REASON_POLICY_L3: "policy denied (L3: peer identity not allowed)",
        datapath_pb2.DROP_REASON_POLICY_L4: "policy denied (L4: port not allowed)",
        datapath_pb2.DROP_REASON_POLICY_DENY: "policy denied by a deny rule",
        datapath_pb2.DROP_REASON_POLICY_NOT_READY: "endpoint policy not loaded yet",
        datapath_pb2.DROP_REASON_NO_BACKEND: "service has no backend",
        datapath_pb2.DROP_REASON_SOURCE_RANGE: "source not in the service's allowed ranges",
        datapath_pb2.DROP_REASON_CT_INSERT_FAILED: "conntrack insert failed",
        datapath_pb2.DROP_REASON_CT_INVALID: "invalid conntrack state",
        datapath_pb2.DROP_REASON_NAT_FAILED: "NAT failed",
        datapath_pb2.DROP_REASON_INVALID_PACKET: "invalid packet",
        datapath_pb2.DROP_REASON_UNSUPPORTED_L3: "unsupported L3 protocol",
        datapath_pb2.DROP_REASON_UNKNOWN_ENDPOINT: "unknown endpoint",
        datapath_pb2.DROP_REASON_FIB_LOOKUP_FAILED: "no route (FIB lookup failed)",
        datapath_pb2.DROP_REASON_REDIRECT_FAILED: "redirect failed",
    }
    return words.get(code, enum_name(datapath_pb2.DropReason, code, "DROP_REASON_"))


def flow_line(f: datapath_pb2.Flow) -> str:
    proto = PROTOCOL_NAMES.get(f.protocol, str(f.protocol))
    verdict = enum_name(datapath_pb2.FlowVerdict, f.verdict, "FLOW_VERDICT_").upper()
    direction = enum_name(datapath_pb2.FlowDirection, f.direction, "FLOW_DIRECTION_")
    line = (
        f"{f.time.ToJsonString()} {verdict:<9} {direction:<7} {proto} "
        f"{f.src_ip}:{f.src_port} (id {f.src_identity}) -> {f.dst_ip}:{f.dst_port} "
        f"(id {f.dst_identity}) endpoint {f.endpoint_id}"
    )
    if f.verdict == datapath_pb2.FLOW_VERDICT_DROPPED:
        line += f": {drop_reason_words(f.drop_reason)}"
    return line


def cmd_monitor(args: argparse.Namespace, clients: Clients) -> int:
    verdicts = {
        "forwarded": datapath_pb2.FLOW_VERDICT_FORWARDED,
        "dropped": datapath_pb2.FLOW_VERDICT_DROPPED,
    }
    request = datapath_pb2.ObserveFlowsRequest(
        verdicts=[verdicts[v] for v in args.verdict],
        endpoint_ids=args.endpoint,
        identities=args.identity,
        ip=args.ip or "",
        port=args.port,
        protocol=PROTOCOLS.get((args.proto or "any").lower(), 0),
        last=args.last,
        follow=not args.no_follow,
    )
    targets = clients.datapaths(args.node or "")
    watches = [FlowWatch(clients, dp, request, args) for dp in targets]
    if len(watches) == 1:
        watches[0].run()
    else:
        # One stream per node, merged as the flows come.
        threads = [threading.Thread(target=w.run, daemon=True) for w in watches]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except KeyboardInterrupt:
            for w in watches:
                w.cancel()
    for w in watches:
        if w.error:
            print(f"flagella: {w.error}", file=sys.stderr)
    return 1 if any(w.error for w in watches) else 0


class FlowWatch:
    """One datapath's flow stream, printed line by line."""

    lock = threading.Lock()

    def __init__(
        self,
        clients: Clients,
        dp: Datapath,
        request: datapath_pb2.ObserveFlowsRequest,
        args: argparse.Namespace,
    ) -> None:
        self.dp = dp
        self.args = args
        self.stream = clients.datapath(dp).ObserveFlows(request, timeout=args.duration or None)
        self.error = ""

    def cancel(self) -> None:
        self.stream.cancel()

    def show(self, f: datapath_pb2.Flow) -> str:
        if self.args.output == "json":
            node = {"node": self.dp.node} if self.dp.node else {}
            return json.dumps({**to_dict(f), **node}, sort_keys=True)
        return f"{self.dp.node} {flow_line(f)}" if self.dp.node else flow_line(f)

    def run(self) -> None:
        try:
            for f in self.stream:
                line = self.show(f)
                with self.lock:
                    print(line, flush=True)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return
            where = f"datapath of node {self.dp.node}" if self.dp.node else "datapath service"
            if code == grpc.StatusCode.UNAVAILABLE:
                self.error = f"{where} unreachable at {self.dp.address}"
            else:
                self.error = f"{self.dp.label}: {code.name if code else 'error'}"
        except KeyboardInterrupt:
            self.cancel()
