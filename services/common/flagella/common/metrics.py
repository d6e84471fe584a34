"""Prometheus metrics of one process: its registry (no global one), the
gRPC server and client metrics of the go-grpc-prometheus convention, the
kvstore (etcd) operations, process metrics, and the HTTP endpoint that
serves them (`--metrics-listen`, a port of its own, off the gRPC port).

Names and labels are go-grpc-prometheus's, so dashboards written for Go
services work unchanged: grpc_server_started_total, grpc_server_handled_total
(with grpc_code), grpc_server_msg_received_total, grpc_server_msg_sent_total,
grpc_server_handling_seconds (a histogram), and the grpc_client_* set.
Label values are method names and codes only: bounded, whatever the traffic.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from flagella.common.handlers import WrappingInterceptor, rewrap
from flagella.common.outcomes import Outcomes

log = logging.getLogger(__name__)

# go's codes.Code.String() for each status: what grpc_code carries.
GO_CODE = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
# prometheus.DefBuckets, go-grpc-prometheus's default.
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
METHOD_LABELS = ("grpc_type", "grpc_service", "grpc_method")
# Start-up phases: from a few milliseconds (config) to minutes (waiting for etcd).
BOOTSTRAP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PHASE_NAME = re.compile(r"[a-z][a-z0-9_]*")


def split_method(full: str) -> tuple[str, str]:
    """("flagella.ipam.v1.IpamService", "AllocateIP") of "/pkg.Service/Method"."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service or "unknown", method or "unknown"


def grpc_type(request_streaming: bool, response_streaming: bool) -> str:
    if request_streaming and response_streaming:
        return "bidi_stream"
    if request_streaming:
        return "client_stream"
    return "server_stream" if response_streaming else "unary"


class GrpcMetrics:
    """One side's (server or client) go-grpc-prometheus metrics."""

    def __init__(self, side: str, registry: CollectorRegistry) -> None:
        what = "completed on the server" if side == "server" else "completed by the client"
        self.started = Counter(
            f"grpc_{side}_started_total",
            f"Total number of RPCs started on the {side}.",
            METHOD_LABELS,
            registry=registry,
        )
        self.handled = Counter(
            f"grpc_{side}_handled_total",
            f"Total number of RPCs {what}, regardless of success or failure.",
            (*METHOD_LABELS, "grpc_code"),
            registry=registry,
        )
        self.received = Counter(
            f"grpc_{side}_msg_received_total",
            f"Total number of RPC stream messages received on the {side}.",
            METHOD_LABELS,
            registry=registry,
        )
        self.sent = Counter(
            f"grpc_{side}_msg_sent_total",
            f"Total number of gRPC stream messages sent by the {side}.",
            METHOD_LABELS,
            registry=registry,
        )
        self.seconds = Histogram(
            f"grpc_{side}_handling_seconds",
            f"Histogram of response latency (seconds) of gRPC that had been {what}.",
            METHOD_LABELS,
            buckets=DEFAULT_BUCKETS,
            registry=registry,
        )

    def call(self, kind: str, full_method: str) -> CallMetrics:
        service, method = split_method(full_method)
        return CallMetrics(self, (kind, service, method))


class CallMetrics:
    """The children of one method's metrics, and the clock of one call."""

    __slots__ = ("handled", "labels", "metrics", "received", "sent", "started_at")

    def __init__(self, metrics: GrpcMetrics, labels: tuple[str, str, str]) -> None:
        self.metrics = metrics
        self.labels = labels
        self.received = metrics.received.labels(*labels)
        self.sent = metrics.sent.labels(*labels)
        self.started_at = 0.0
        self.handled = False

    def start(self) -> None:
        self.metrics.started.labels(*self.labels).inc()
        self.started_at = time.perf_counter()

    def finish(self, code: grpc.StatusCode) -> None:
        if self.handled:
            return
        self.handled = True
        self.metrics.handled.labels(*self.labels, GO_CODE.get(code, "Unknown")).inc()
        self.metrics.seconds.labels(*self.labels).observe(time.perf_counter() - self.started_at)


def outcome_histogram(
    registry: CollectorRegistry,
    name: str,
    what: str,
    label: str,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
) -> Histogram:
    """A histogram of durations of `what`, by label and outcome."""
    return Histogram(
        name,
        f"Duration of {what}, by {label} and outcome.",
        (label, "outcome"),
        buckets=buckets,
        registry=registry,
    )


class KvstoreMetrics:
    """etcd operations as Cilium reports its kvstore's
    (cilium_kvstore_operations_duration_seconds): per etcd RPC (the
    action: Range, Txn, Put, DeleteRange, LeaseGrant, ...) and outcome."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = outcome_histogram(
            registry,
            "flagella_kvstore_operations_duration_seconds",
            "kvstore (etcd) operations (the action: the etcd RPC)",
            "action",
        )

    def interceptor(self) -> grpc.aio.ClientInterceptor:
        return _KvstoreInterceptor(self)


class BootstrapMetrics:
    """How long each start-up phase took and how it ended, as Cilium's
    cilium_agent_bootstrap_seconds{scope,outcome}: the bootstrap records its
    own phases (config, tls, listen, start, serving) and a service adds its
    own with Runtime.phase(name). "serving" is the time from the bootstrap's
    start until the service answers SERVING."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.started_at = time.perf_counter()
        self.seconds = outcome_histogram(
            registry, "flagella_bootstrap_seconds", "start-up phases", "phase", BOOTSTRAP_BUCKETS
        )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as phase `name`: outcome success, or failure when
        it raises (cancellation included)."""
        if not PHASE_NAME.fullmatch(name):
            raise ValueError(f"phase {name!r}: lower case letters, digits and _")
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self.record(name, time.perf_counter() - started, "failure")
            raise
        self.record(name, time.perf_counter() - started, "success")

    def record(self, name: str, seconds: float, outcome: str = "success") -> None:
        self.seconds.labels(name, outcome).observe(seconds)

    def serving(self) -> None:
        self.record("serving", time.perf_counter() - self.started_at)


def outcome_family(
    name: str, documentation: str, labels: Sequence[str], outcomes: Outcomes
) -> CounterMetricFamily:
    """Counts of flagella.common.outcomes as a counter family (name without
    _total); labels name the count's keys, outcome last."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, count in sorted(outcomes.counts.items()):
        family.add_metric(key, count)
    return family


# A young collection takes microseconds; a full one over a large heap
# (a policy replica holding 50,000 identities) can stall the event loop.
GC_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class GcPauses:
    """How long each of the interpreter's garbage collections held the
    process, by generation: a stalled event loop shows up here, not in
    prometheus_client's collection counts. The callback only adds to plain
    lists (it runs inside an allocation: no lock may be taken there); the
    histogram is built at scrape time."""

    def __init__(self) -> None:
        self._started = 0.0
        size = len(GC_PAUSE_BUCKETS) + 1
        self._counts = [[0] * size for _ in range(3)]
        self._sums = [0.0, 0.0, 0.0]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = min(info.get("generation", 2), 2)
        self._counts[generation][bisect.bisect_left(GC_PAUSE_BUCKETS, took)] += 1
        self._sums[generation] += took

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "flagella_python_gc_pause_seconds",
            "Time each garbage collection of the interpreter held the process, by generation.",
            labels=["generation"],
        )
        for generation in range(3):
            counts, total = list(self._counts[generation]), 0
            buckets = []
            for bound, count in zip((*map(str, GC_PAUSE_BUCKETS), "+Inf"), counts, strict=True):
                total += count
                buckets.append((bound, total))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        return [family]


class Metrics:
    """The metrics of one process (held by its Runtime)."""

    def __init__(self, service: str) -> None:
        # No *_created series: Go's client (and so Cilium's metrics) has none,
        # and they double the series of every counter and histogram.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in 0.26
        self.service = service
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(GC_COLLECTOR)
        # Installed by the process's entry point (gc.callbacks is the
        # interpreter's, not this object's).
        self.gc_pauses = GcPauses()
        self.registry.register(self.gc_pauses)
        self.server = GrpcMetrics("server", self.registry)
        self.client = GrpcMetrics("client", self.registry)
        self.kvstore = KvstoreMetrics(self.registry)
        self.bootstrap = BootstrapMetrics(self.registry)

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _ServerInterceptor(self.server)

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [
            _UnaryUnary(self.client),
            _UnaryStream(self.client),
            _StreamUnary(self.client),
            _StreamStream(self.client),
        ]

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The registry in the text format the scraper asked for (Accept)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


# --- server ---


def _status(context: Any, default: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return default if code is None else grpc.StatusCode.UNKNOWN


class _ServerInterceptor(WrappingInterceptor):
    """Outermost, so it also counts what authorization refuses."""

    def __init__(self, metrics: GrpcMetrics) -> None:
        self.metrics = metrics

    def wrap(self, handler: Any, method: str) -> Any:
        kind = grpc_type(handler.request_streaming, handler.response_streaming)
        metrics = self.metrics

        async def requests(stream: Any, call: CallMetrics) -> AsyncIterator[Any]:
            async for item in stream:
                call.received.inc()
                yield item

        def incoming(request: Any, call: CallMetrics) -> Any:
            if handler.request_streaming:
                return requests(request, call)
            call.received.inc()
            return request

        def unary(inner: Callable[..., Any]) -> Callable[..., Any]:
            async def answer(request: Any, context: Any) -> Any:
                call = metrics.call(kind, method)
                with _handling(call, context):
                    response = await inner(incoming(request, call), context)
                    call.sent.inc()
                return response

            return answer

        def stream(inner: Callable[..., Any]) -> Callable[..., Any]:
            async def answer(request: Any, context: Any) -> AsyncIterator[Any]:
                call = metrics.call(kind, method)
                with _handling(call, context):
                    result = inner(incoming(request, call), _CountingWrites(context, call))
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            call.sent.inc()
                            yield item
                    else:  # a handler writing with context.write
                        await result

            return answer

        return rewrap(handler, unary, stream, streaming_requests=True)


@contextlib.contextmanager
def _handling(call: CallMetrics, context: Any) -> Iterator[None]:
    """Times the call and counts it with the status it ends with."""
    call.start()
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):
        call.finish(grpc.StatusCode.CANCELLED)
        raise
    except grpc.aio.AbortError:
        call.finish(_status(context, grpc.StatusCode.UNKNOWN))
        raise
    except Exception:
        call.finish(grpc.StatusCode.UNKNOWN)
        raise
    call.finish(_status(context, grpc.StatusCode.OK))


class _CountingWrites:
    """A servicer context whose write() counts the message sent (handlers
    that stream with context.write instead of yielding)."""

    def __init__(self, context: Any, call: CallMetrics) -> None:
        self._context = context
        self._call = call

    async def write(self, message: Any) -> None:
        await self._context.write(message)
        self._call.sent.inc()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


# --- client ---


class _ClientBase:
    def __init__(self, metrics: GrpcMetrics) -> None:
        self.metrics = metrics
        # Calls whose status is being read (a done callback cannot await).
        self._pending: set[asyncio.Task[None]] = set()

    def begin(self, kind: str, details: grpc.aio.ClientCallDetails) -> CallMetrics:
        method = details.method
        full = method.decode() if isinstance(method, bytes) else str(method)
        call = self.metrics.call(kind, full)
        call.start()
        return call

    async def follow(
        self, kind: str, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        """Start a streaming call, counted when it ends (it outlives us)."""
        call = self.begin(kind, details)
        if kind == "server_stream":
            call.sent.inc()  # its one request
        rpc = await continuation(details, request)
        self.on_done(call, rpc)
        return rpc

    def on_done(self, call: CallMetrics, rpc: Any) -> None:
        async def record(done: Any) -> None:
            try:
                code = await done.code()
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
            call.finish(code)

        def done(rpc_call: Any) -> None:
            task = asyncio.get_running_loop().create_task(record(rpc_call))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

        rpc.add_done_callback(done)


class _UnaryUnary(_ClientBase, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        call = self.begin("unary", client_call_details)
        call.sent.inc()
        rpc = await continuation(client_call_details, request)
        try:
            await rpc  # the answer; the caller awaits the same call again
        except grpc.aio.AioRpcError as exc:
            call.finish(exc.code())
        except asyncio.CancelledError:
            call.finish(grpc.StatusCode.CANCELLED)
            raise
        else:
            call.received.inc()
            call.finish(grpc.StatusCode.OK)
        return rpc


class _UnaryStream(_ClientBase, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await self.follow("server_stream", continuation, client_call_details, request)


class _StreamUnary(_ClientBase, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self.follow(
            "client_stream", continuation, client_call_details, request_iterator
        )


class _StreamStream(_ClientBase, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self.follow("bidi_stream", continuation, client_call_details, request_iterator)


class _KvstoreInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Times each unary etcd RPC (watches and lease keep-alives are streams:
    not operations)."""

    def __init__(self, metrics: KvstoreMetrics) -> None:
        self.metrics = metrics

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        method = client_call_details.method
        full = method.decode() if isinstance(method, bytes) else str(method)
        action = split_method(full)[1]
        started = time.perf_counter()
        rpc = await continuation(client_call_details, request)
        outcome = "success"
        try:
            await rpc
        except grpc.aio.AioRpcError:
            outcome = "failure"
        except asyncio.CancelledError:
            outcome = "failure"
            raise
        finally:
            self.metrics.duration.labels(action, outcome).observe(time.perf_counter() - started)
        return rpc


# --- the endpoint ---


class HttpSite:
    """An aiohttp Application served on host:port (port 0: any) in this
    event loop: the metrics endpoint's, and the relay's flows page
    (handler_cancellation: a client that leaves cancels its handler)."""

    def __init__(self, what: str, address: str, *, handler_cancellation: bool = False) -> None:
        self.what = what
        self.address = address
        self.handler_cancellation = handler_cancellation
        self._runner: Any = None
        self.port = 0

    async def start(self, app: Any) -> None:
        from aiohttp import web

        runner = web.AppRunner(app, access_log=None, handler_cancellation=self.handler_cancellation)
        await runner.setup()
        host, _, port = self.address.rpartition(":")
        site = web.TCPSite(runner, host.strip("[]") or None, int(port))
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        sockets = getattr(site._server, "sockets", None) or ()
        self.port = sockets[0].getsockname()[1] if sockets else int(port)
        log.info(f"{self.what} listening", extra={"address": f"{host}:{self.port}"})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class MetricsServer:
    """GET /metrics over HTTP on its own address (aiohttp, in the event
    loop: collectors read the service's state without locks)."""

    def __init__(self, metrics: Metrics, address: str) -> None:
        self.metrics = metrics
        self.address = address
        self._site = HttpSite("metrics", address)

    @property
    def port(self) -> int:
        return self._site.port

    async def start(self) -> None:
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            body, content_type = self.metrics.exposition(request.headers.get("Accept", ""))
            return web.Response(body=body, headers={"Content-Type": content_type})

        app = web.Application()
        app.router.add_get("/metrics", handle)
        await self._site.start(app)

    async def stop(self) -> None:
        await self._site.stop()
