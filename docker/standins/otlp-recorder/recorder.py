"""A recording OTLP trace receiver: a stand-in for Jaeger where no Jaeger image
can be pulled (the compose test; offline machines).

It receives OTLP/gRPC on 4317 as Jaeger all-in-one does (TraceService/Export,
with the standard gRPC health service beside it) and answers the part of
Jaeger's query API (port 16686) that tests and scripts use, in Jaeger's JSON
shapes, so the same client code works against the real Jaeger:

    GET /api/services                     {"data": ["flagella-ipam", ...]}
    GET /api/traces?service=NAME[&limit=N] {"data": [trace, ...]}
    GET /api/traces/TRACE_ID              {"data": [trace]}

A trace is {"traceID", "spans": [{"traceID", "spanID", "operationName",
"references": [{"refType": "CHILD_OF", "traceID", "spanID"}], "startTime",
"duration", "tags", "processID"}], "processes": {"p1": {"serviceName"}}}.
Spans are kept in memory only (the last --max-spans of them).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from collections import deque
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

log = logging.getLogger("otlp-recorder")


@dataclass(frozen=True)
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_us: int
    duration_us: int
    attributes: dict[str, str] = field(default_factory=dict)


def any_value(value: common_pb2.AnyValue) -> str:
    kind = value.WhichOneof("value")
    return "" if kind is None else str(getattr(value, kind))


class Store:
    def __init__(self, max_spans: int) -> None:
        self.lock = threading.Lock()
        self.spans: deque[Span] = deque(maxlen=max_spans)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> int:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: any_value(a.value) for a in rs.resource.attributes}
            service = resource.get("service.name", "unknown_service")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            service=service,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            start_us=s.start_time_unix_nano // 1000,
                            duration_us=max(0, s.end_time_unix_nano - s.start_time_unix_nano)
                            // 1000,
                            attributes={a.key: any_value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(spans)
        return len(spans)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def services(self) -> list[str]:
        return sorted({s.service for s in self.snapshot()})

    def traces(self, *, service: str = "", trace_id: str = "", limit: int = 20) -> list[Any]:
        by_trace: dict[str, list[Span]] = {}
        for s in self.snapshot():
            by_trace.setdefault(s.trace_id, []).append(s)
        selected = [
            spans
            for tid, spans in by_trace.items()
            if (not trace_id or tid == trace_id)
            and (not service or any(s.service == service for s in spans))
        ]
        selected.sort(key=lambda spans: -min(s.start_us for s in spans))
        return [jaeger_trace(spans) for spans in selected[:limit]]


def jaeger_trace(spans: list[Span]) -> dict[str, Any]:
    processes: dict[str, str] = {}
    for s in spans:
        processes.setdefault(s.service, f"p{len(processes) + 1}")
    return {
        "traceID": spans[0].trace_id,
        "spans": [
            {
                "traceID": s.trace_id,
                "spanID": s.span_id,
                "operationName": s.name,
                "references": (
                    [{"refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_span_id}]
                    if s.parent_span_id
                    else []
                ),
                "startTime": s.start_us,
                "duration": s.duration_us,
                "tags": [
                    {"key": "span.kind", "type": "string", "value": KINDS.get(s.kind, "")},
                    *(
                        {"key": k, "type": "string", "value": v}
                        for k, v in sorted(s.attributes.items())
                    ),
                ],
                "processID": processes[s.service],
            }
            for s in sorted(spans, key=lambda s: s.start_us)
        ],
        "processes": {pid: {"serviceName": svc, "tags": []} for svc, pid in processes.items()},
        "warnings": None,
    }


KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        count = self.store.add(request)
        log.debug("recorded %d spans", count)
        return trace_service_pb2.ExportTraceServiceResponse()


def query_handler(store: Store) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            if url.path == "/api/services":
                self.reply(200, {"data": store.services(), "total": len(store.services())})
            elif url.path == "/api/traces":
                limit = int(query.get("limit", ["20"])[0])
                data = store.traces(service=query.get("service", [""])[0], limit=limit)
                self.reply(200, {"data": data, "total": len(data)})
            elif url.path.startswith("/api/traces/"):
                data = store.traces(trace_id=url.path.rsplit("/", 1)[1], limit=1)
                if data:
                    self.reply(200, {"data": data, "total": 1})
                else:
                    self.reply(404, {"data": None, "errors": [{"code": 404, "msg": "not found"}]})
            elif url.path in ("/", "/healthz"):
                self.reply(200, {"spans": len(store.snapshot())})
            else:
                self.reply(404, {"errors": [{"code": 404, "msg": f"no route {url.path}"}]})

        def reply(self, code: int, body: object) -> None:
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def address_string(self) -> str:  # no reverse DNS look-ups
            return str(self.client_address[0])

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser(prog="otlp-recorder", description=__doc__)
    parser.add_argument("--otlp-listen", default="0.0.0.0:4317")
    parser.add_argument("--query-host", default="0.0.0.0")
    parser.add_argument("--query-port", type=int, default=16686)
    parser.add_argument("--max-spans", type=int, default=100_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format='{"msg": "%(message)s"}')

    store = Store(args.max_spans)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        TraceService(store), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(args.otlp_listen)
    server.start()
    http = ThreadingHTTPServer((args.query_host, args.query_port), query_handler(store))
    threading.Thread(target=http.serve_forever, name="query", daemon=True).start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("OTLP on %s, query API on %s:%d", args.otlp_listen, args.query_host, args.query_port)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    http.shutdown()
    server.stop(1).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
