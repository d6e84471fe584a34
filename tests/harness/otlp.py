"""A recording OTLP/gRPC trace receiver (what Jaeger listens for on 4317),
built on the opentelemetry-proto stubs: tests point services at it and
assert on the spans they export."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from harness.net import free_port


@dataclass(frozen=True)
class RecordedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, str]


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self.sink = sink

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        spans = []
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = attrs.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        RecordedSpan(
                            service=service,
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={
                                a.key: str(a.value.string_value or a.value.int_value)
                                for a in s.attributes
                            },
                        )
                    )
        with self.sink.lock:
            self.sink.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    SPAN_KIND_INTERNAL = 1
    SPAN_KIND_SERVER = 2
    SPAN_KIND_CLIENT = 3

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.spans: list[RecordedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0)

    def env(self) -> dict[str, str]:
        """Environment that makes a service export here, quickly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def wait_for(
        self, predicate: Callable[[list[RecordedSpan]], bool], timeout: float = 20.0
    ) -> list[RecordedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                snapshot = list(self.spans)
            if predicate(snapshot):
                return snapshot
            time.sleep(0.05)
        with self.lock:
            raise AssertionError(f"spans never matched; got {self.spans}")
