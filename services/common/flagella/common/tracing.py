"""OpenTelemetry tracing of gRPC servers and clients, exported over OTLP/gRPC
(what Jaeger receives on 4317) when OTEL_EXPORTER_OTLP_ENDPOINT is set.

The tracer provider is held by the service's runtime and handed to the
interceptors explicitly; nothing is installed globally except the standard
W3C trace-context propagator the instrumentation uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def _not_health_or_reflection() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(
        filters.any_of(
            filters.service_prefix("grpc.health."),
            filters.service_prefix("grpc.reflection."),
        )
    )


@dataclass
class Tracing:
    """Tracing of one process; disabled (no interceptors) without an endpoint."""

    service_name: str
    provider: TracerProvider | None

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def tracer(self, name: str) -> trace.Tracer:
        if self.provider is None:
            return trace.NoOpTracer()
        return self.provider.get_tracer(name)

    def server_interceptors(self) -> list[Any]:
        if self.provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [
            aio_server_interceptor(  # type: ignore[no-untyped-call]
                self.provider, filter_=_not_health_or_reflection()
            )
        ]

    def client_interceptors(self) -> list[Any]:
        if self.provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        return list(
            aio_client_interceptors(  # type: ignore[no-untyped-call]
                self.provider, filter_=_not_health_or_reflection()
            )
        )

    def shutdown(self) -> None:
        """Flush pending spans."""
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(service_name: str, environ: Mapping[str, str]) -> Tracing:
    """Tracing for ``service_name`` (e.g. flagella-ipam), from the standard
    OTEL_* environment (endpoint, batch delays, resource attributes)."""
    if not environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") and not environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    ):
        return Tracing(service_name, None)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    resource = Resource.create({"service.name": service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(service_name, provider)
