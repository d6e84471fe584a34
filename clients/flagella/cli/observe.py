"""`flagella observe`: flows from every node (through the relay; from the
datapaths named by --node or --datapath-address directly) as
`hubble observe` shows them: a table, or with `-o json` one Hubble flow per
line (flagella.common.flows), each end named (pod, namespace, labels) from
the endpoint and policy services. `flagella monitor`, its predecessor, stays
with its own flags and JSON (the datapath's Flow message).

Filters the datapath can apply (verdict, drop reason, direction, identity,
port, protocol, time) go in the request; those on names and labels are
applied here, on the enriched flow."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable
from datetime import UTC, datetime

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.api.relay.v1 import relay_pb2
from flagella.cli.base import PROTOCOL_NAMES, PROTOCOLS, Clients, CliError, enum_name, to_dict
from flagella.cli.targets import Datapath
from flagella.common import flows as hubble

ALL = 2**32 - 1  # `last`: every buffered flow
HUBBLE_DEFAULT_LAST = 20  # what `hubble observe` shows without --last/--since/--follow


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


def flow_line(f: datapath_pb2.Flow, src: str = "", dst: str = "") -> str:
    """A flow as a table line; src and dst name the ends (e.g. shop/db)."""
    proto = PROTOCOL_NAMES.get(f.protocol, str(f.protocol))
    verdict = enum_name(datapath_pb2.FlowVerdict, f.verdict, "FLOW_VERDICT_").upper()
    direction = enum_name(datapath_pb2.FlowDirection, f.direction, "FLOW_DIRECTION_")
    src_id = f"{src}, id {f.src_identity}" if src else f"id {f.src_identity}"
    dst_id = f"{dst}, id {f.dst_identity}" if dst else f"id {f.dst_identity}"
    line = (
        f"{f.time.ToJsonString()} {verdict:<9} {direction:<7} {proto} "
        f"{f.src_ip}:{f.src_port} ({src_id}) -> {f.dst_ip}:{f.dst_port} "
        f"({dst_id}) endpoint {f.endpoint_id}"
    )
    if f.verdict in (datapath_pb2.FLOW_VERDICT_DROPPED, datapath_pb2.FLOW_VERDICT_AUDIT):
        line += f": {drop_reason_words(f.drop_reason)}"
    if f.denied_by:
        line += f" (by {', '.join(f.denied_by)})"
    return line


# --- the directory: names of the ends ---


class Names:
    """The endpoint, policy and lb services' view of pods, identities and
    services, loaded
    once and again when a flow names an end it does not know (a pod created
    since), at most every hubble.REFRESH_SECONDS."""

    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self.directory = hubble.Directory()
        self._loaded = 0.0
        self.load()

    def load(self) -> None:
        c = self.clients
        eps = c.call("endpoint", c.endpoint().ListEndpoints, endpoint_pb2.ListEndpointsRequest())
        idents = c.call("policy", c.policy().ListIdentities, policy_pb2.ListIdentitiesRequest())
        svcs = c.call("lb", c.lb().ListServices, lb_pb2.ListServicesRequest())
        self.directory = hubble.directory(eps.endpoints, idents.identities, svcs.services)
        self._loaded = time.monotonic()

    def of(self, f: datapath_pb2.Flow) -> hubble.Directory:
        if hubble.stale(self.directory, f, self._loaded, time.monotonic()):
            self.load()
        return self.directory


# --- the streams ---


class FlowWatch:
    """One datapath's flow stream, its flows put on a shared queue (printed
    by the main thread, so a closed pipe ends the command there)."""

    def __init__(
        self,
        clients: Clients,
        dp: Datapath,
        request: datapath_pb2.ObserveFlowsRequest,
        duration: float,
        out: queue.Queue[tuple[Datapath, datapath_pb2.Flow | None]],
    ) -> None:
        self.dp = dp
        self.out = out
        self.stream = clients.datapath(dp).ObserveFlows(request, timeout=duration or None)
        self.error = ""

    def cancel(self) -> None:
        self.stream.cancel()

    def run(self) -> None:
        try:
            for f in self.stream:
                self.out.put((self.dp, f))
        except grpc.RpcError as exc:
            self.error = stream_error(self.dp, exc)
        finally:
            self.out.put((self.dp, None))


def stream_error(dp: Datapath, exc: grpc.RpcError) -> str:
    """ "" for a stream that ended as asked (its --duration, a cancel)."""
    code = exc.code() if hasattr(exc, "code") else None
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return ""
    where = f"datapath of node {dp.node}" if dp.node else "datapath service"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{where} unreachable at {dp.address}"
    details = exc.details() if hasattr(exc, "details") else ""
    return f"{dp.label}: {code.name if code else 'error'}" + (f": {details}" if details else "")


def follow(
    clients: Clients,
    requests: dict[Datapath, datapath_pb2.ObserveFlowsRequest],
    duration: float,
) -> tuple[Generator[tuple[Datapath, datapath_pb2.Flow]], Callable[[], list[str]]]:
    """Every datapath's stream, merged as the flows come; and the errors of
    those that failed (once the iterator is done)."""
    out: queue.Queue[tuple[Datapath, datapath_pb2.Flow | None]] = queue.Queue()
    watches = [FlowWatch(clients, dp, req, duration, out) for dp, req in requests.items()]

    def merged() -> Generator[tuple[Datapath, datapath_pb2.Flow]]:
        for w in watches:
            threading.Thread(target=w.run, daemon=True).start()
        running = len(watches)
        try:
            while running:
                dp, f = out.get()
                if f is None:
                    running -= 1
                else:
                    yield dp, f
        finally:
            for w in watches:
                w.cancel()

    return merged(), lambda: [w.error for w in watches if w.error]


def printing(lines: Iterable[str]) -> bool:
    """Prints lines as they come; False when the reader went away
    (`flagella observe | head`), which ends the command quietly."""
    try:
        for line in lines:
            print(line, flush=True)
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
    except KeyboardInterrupt:
        pass
    return True


def report(errors: Iterable[str]) -> int:
    errors = list(errors)
    for error in errors:
        print(f"flagella: {error}", file=sys.stderr)
    return 1 if errors else 0


# --- flagella monitor ---


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
    flows, errors = follow(clients, dict.fromkeys(targets, request), args.duration)

    def show(dp: Datapath, f: datapath_pb2.Flow) -> str:
        if args.output == "json":
            node = {"node": dp.node} if dp.node else {}
            return json.dumps({**to_dict(f), **node}, sort_keys=True)
        return f"{dp.node} {flow_line(f)}" if dp.node else flow_line(f)

    printing(show(dp, f) for dp, f in flows)
    flows.close()  # cancels the streams
    return report(errors())


# --- flagella observe ---


def parse_since(text: str, now: float) -> float:
    """--since: a duration back from now (30s, 5m, 1h30m) or an RFC 3339 time."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if text and parts:
        h, m, s = (float(p) if p else 0.0 for p in parts.groups())
        return now - (h * 3600 + m * 60 + s)
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise CliError(
            f"--since {text!r}: give a duration (30s, 5m, 1h30m) or an RFC 3339 time"
        ) from None


def observe_request(args: argparse.Namespace, now: float) -> datapath_pb2.ObserveFlowsRequest:
    """The node's part of the filters; `last` and `follow` set by the caller."""
    verdicts = {
        "FORWARDED": datapath_pb2.FLOW_VERDICT_FORWARDED,
        "DROPPED": datapath_pb2.FLOW_VERDICT_DROPPED,
        "AUDIT": datapath_pb2.FLOW_VERDICT_AUDIT,
    }
    directions = {
        "INGRESS": datapath_pb2.FLOW_DIRECTION_INGRESS,
        "EGRESS": datapath_pb2.FLOW_DIRECTION_EGRESS,
    }
    reasons: list[datapath_pb2.DropReason.ValueType] = []
    for spec in args.drop_reason:
        try:
            reasons += hubble.drop_reasons(spec)
        except ValueError as exc:
            raise CliError(f"--drop-reason: {exc}") from None
    protocol = (args.protocol or "any").lower()
    if protocol not in PROTOCOLS:
        raise CliError(f"--protocol {args.protocol!r}: one of {', '.join(sorted(PROTOCOLS))}")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: not a port")
    if not 0 <= args.last < ALL:
        raise CliError(f"--last {args.last}: not a count")
    request = datapath_pb2.ObserveFlowsRequest(
        verdicts=[verdicts[v.upper()] for v in args.verdict],
        drop_reasons=reasons,
        directions=[directions[d.upper()] for d in args.traffic_direction],
        identities=args.identity,
        port=args.port,
        protocol=PROTOCOLS[protocol],
    )
    if args.since:
        request.since.CopyFrom(_timestamp(parse_since(args.since, now)))
    return request


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def end_filter(args: argparse.Namespace) -> hubble.EndFilter:
    try:
        selectors = tuple(hubble.Selector.parse(s) for s in args.label)
    except ValueError as exc:
        raise CliError(f"--label: {exc}") from None
    return hubble.EndFilter(
        pods=tuple(args.pod),
        namespaces=tuple(args.namespace),
        labels=selectors,
        identities=frozenset(args.identity),
    )


def observed_nodes(clients: Clients, patterns: list[str]) -> list[Datapath]:
    """The datapaths whose node matches a --node (globs), else all."""
    if not patterns:
        return clients.datapaths()
    if clients.args.datapath_address:
        raise CliError("--node and --datapath-address name the same thing: give one")
    every = clients.datapaths()
    targets = [dp for dp in every if any(fnmatch.fnmatch(dp.node, p) for p in patterns)]
    if not targets:
        raise CliError(f"no node with a datapath matches --node {', '.join(patterns)}")
    return targets


def cmd_observe(args: argparse.Namespace, clients: Clients) -> int:
    base = observe_request(args, time.time())
    wanted = end_filter(args)
    direct = bool(args.node or clients.args.datapath_address)
    targets = observed_nodes(clients, args.node) if direct else []
    names = Names(clients)
    # How many buffered flows to show (None: all since --since), as hubble.
    keep: int | None = args.last or (
        None if args.since else 0 if args.follow else HUBBLE_DEFAULT_LAST
    )

    def show(f: datapath_pb2.Flow) -> str | None:
        """The flow's line, None when a filter here leaves it out."""
        shape = hubble.to_hubble(f, names.of(f))
        if not wanted.matches(shape):
            return None
        if args.output == "json":
            return json.dumps(shape, separators=(",", ":"))
        src, dst = (_name(shape["flow"].get(end, {})) for end in ("source", "destination"))
        line = flow_line(f, src, dst)
        return f"{f.node} {line}" if f.node else line

    if not direct:
        return _through_relay(args, clients, base, keep=keep, by_end=wanted.by_end, show=show)

    # The buffered flows first, all nodes' in time order, the filters here
    # applied before --last counts; then (--follow) each node's new ones
    # from just after the last it sent.
    requests: dict[Datapath, datapath_pb2.ObserveFlowsRequest] = {}
    buffered: list[datapath_pb2.Flow] = []
    errors: list[str] = []
    for dp in targets:
        req = datapath_pb2.ObserveFlowsRequest()
        req.CopyFrom(base)
        if keep != 0:
            req.last = keep if keep and not wanted.by_end else ALL
            got, err = _buffered(clients, dp, req, args.timeout)
            buffered += got
            errors += err
            if err:
                continue  # reported once, not followed
            if got:
                req.since.FromNanoseconds(max(f.time.ToNanoseconds() for f in got) + 1)
        req.last, req.follow = (ALL if keep != 0 else 0), True
        requests[dp] = req
    buffered.sort(key=lambda f: f.time.ToNanoseconds())
    lines = [line for f in buffered if (line := show(f))]
    reading = printing(lines[-keep:] if keep else lines if keep is None else [])
    if args.follow and reading:
        live, live_errors = follow(clients, requests, args.duration)
        printing(line for _, f in live if (line := show(f)))
        live.close()  # cancels the streams
        errors += live_errors()
    return report(errors)


def _buffered(
    clients: Clients, dp: Datapath, request: datapath_pb2.ObserveFlowsRequest, timeout: float
) -> tuple[list[datapath_pb2.Flow], list[str]]:
    try:
        return list(clients.datapath(dp).ObserveFlows(request, timeout=timeout)), []
    except grpc.RpcError as exc:
        return [], [stream_error(dp, exc) or f"{dp.label}: no answer within {timeout}s"]


def _name(ep: dict[str, str]) -> str:
    if ep.get("pod_name"):
        return f"{ep.get('namespace', '')}/{ep['pod_name']}"
    return ""


# --- through the relay ---


def relay_event_line(event: relay_pb2.ObserveResponse, output: str) -> str:
    """A node status or lost event as a line (JSON: as hubble prints them)."""
    now = datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
    if event.HasField("node_status"):
        st = event.node_status
        connected = st.state == relay_pb2.NODE_STATE_CONNECTED
        if output == "json":
            return json.dumps(hubble.node_status(st.node, connected, st.message, now))
        state = "CONNECTED" if connected else "UNAVAILABLE"
        return f"{now} node {st.node} {state}" + (f": {st.message}" if st.message else "")
    lost = event.lost
    if output == "json":
        return json.dumps(hubble.lost_events(lost.node, lost.count, now))
    return f"{now} LOST {lost.count} flows of node {lost.node} (the relay's queue was full)"


def relay_error(address: str, exc: grpc.RpcError) -> str:
    """The relay's stream failing mid-way ("" : it ended as asked)."""
    code = exc.code() if hasattr(exc, "code") else None
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"relay service unreachable at {address}"
    details = exc.details() if hasattr(exc, "details") else ""
    return f"relay: {code.name if code else 'error'}: {details}"


def _through_relay(
    args: argparse.Namespace,
    clients: Clients,
    base: datapath_pb2.ObserveFlowsRequest,
    *,
    keep: int | None,
    by_end: bool,
    show: Callable[[datapath_pb2.Flow], str | None],
) -> int:
    """observe through the relay: one stream of every node's flows in time
    order, with node status and lost events; the same two steps as the
    datapaths' (the buffered flows, the filters here before --last counts;
    then --follow from just after the newest)."""
    stub = clients.relay()

    def line(event: relay_pb2.ObserveResponse) -> str | None:
        """A flow's line (None: filtered out here), or an event's."""
        if event.HasField("flow"):
            return show(event.flow)
        return relay_event_line(event, args.output)

    req = datapath_pb2.ObserveFlowsRequest()
    req.CopyFrom(base)
    if keep != 0:
        req.last = keep if keep and not by_end else ALL
        events = clients.call(
            "relay",
            lambda r, **kw: list(stub.ObserveFlows(r, **kw)),
            relay_pb2.ObserveRequest(filter=req),
        )
        flows = [e.flow for e in events if e.HasField("flow")]
        lines = [text for e in events if (text := line(e)) is not None and e.HasField("flow")]
        marks = [text for e in events if not e.HasField("flow") and (text := line(e))]
        if not printing([*marks, *(lines[-keep:] if keep else lines)]):
            return 0
        if flows:
            req.since.FromNanoseconds(max(f.time.ToNanoseconds() for f in flows) + 1)
    if not args.follow:
        return 0
    req.last, req.follow = (ALL if keep != 0 else 0), True
    live = stub.ObserveFlows(relay_pb2.ObserveRequest(filter=req), timeout=args.duration or None)
    try:
        printing(text for e in live if (text := line(e)) is not None)
    except grpc.RpcError as exc:
        return report(e for e in [relay_error(args.relay_address, exc)] if e)
    finally:
        live.cancel()
    return 0
