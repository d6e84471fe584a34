"""The one bootstrap every flagella service runs on.

It parses the typed config (exit 2 with a one-line reason when it is bad),
sets up JSON logs and tracing, and serves grpc.aio with the standard health
service (NOT_SERVING until the service is ready, and again on SIGTERM before a
graceful stop), server reflection, OpenTelemetry interceptors and the error
interceptor that maps domain errors to gRPC status codes. Every port
requires mutual TLS and every call is authorized (flagella.common.authz)
unless --insecure, a development switch, says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from flagella.common import addresses, tls
from flagella.common.authz import AuthInterceptor, Authorizer
from flagella.common.config import ServiceConfig, load_config
from flagella.common.debuginfo import Debuginfo
from flagella.common.errors import ConfigError, FlagellaError
from flagella.common.etcd import Etcd
from flagella.common.handlers import WrappingInterceptor, relay, rewrap
from flagella.common.keepalive import Keepalive
from flagella.common.logs import RecentRecords, setup_logging
from flagella.common.metrics import Metrics, MetricsServer
from flagella.common.pki import TlsFileError
from flagella.common.tasks import TaskGroup
from flagella.common.tls import TlsFiles
from flagella.common.tracing import Tracing, setup_tracing

log = logging.getLogger(__name__)

C = TypeVar("C", bound=ServiceConfig)


class FatalError(Exception):
    """Raised by a service's start() when it cannot ever become ready."""


# --- error mapping ---


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a handler exception answers with."""
    if isinstance(exc, FlagellaError):
        return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN), exc.details
    if isinstance(exc, grpc.aio.AioRpcError):
        # A peer's error passes through with its code; a peer that is down
        # or slow is UNAVAILABLE to our caller, who may retry.
        code = exc.code()
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            code = grpc.StatusCode.UNAVAILABLE
        return code, f"peer: {exc.details()}"
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, "method not implemented"
    return grpc.StatusCode.INTERNAL, "internal error"


class ErrorInterceptor(WrappingInterceptor):
    """Turns exceptions escaping a handler into a status: domain errors into
    their code with their message, anything else into INTERNAL with a generic
    message and a logged traceback. Until the service has started, its own
    RPCs answer UNAVAILABLE (health and reflection always answer)."""

    def __init__(self, readiness: Readiness | None = None) -> None:
        self.readiness = readiness

    def wrap(self, handler: Any, method: str) -> Any:
        starting = (
            self.readiness is not None
            and not self.readiness.started
            and not method.startswith(("/grpc.health.", "/grpc.reflection."))
        )

        async def fail(exc: BaseException, context: Any) -> None:
            code, details = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.error("unhandled error", exc_info=exc, extra={"method": method})
            elif code != grpc.StatusCode.UNIMPLEMENTED:
                log.info(
                    "call failed", extra={"method": method, "code": code.name, "details": details}
                )
            await context.abort(code, details)

        def unary(inner: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: Any) -> Any:
                if starting:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "service is starting")
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await fail(exc, context)

            return call

        readiness = self.readiness

        def stream(inner: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: Any) -> AsyncIterator[Any]:
                if starting:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "service is starting")
                if readiness is None:
                    try:
                        async for item in relay(inner(request, context)):
                            yield item
                    except grpc.aio.AbortError:
                        raise
                    except Exception as exc:
                        await fail(exc, context)
                    return
                items = relay(inner(request, context))
                with readiness.stream() as answer:
                    while True:
                        if readiness.stopping:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, "server stopping")
                        try:
                            with answer.waiting():
                                item = await anext(items)
                        except StopAsyncIteration:
                            return
                        except grpc.aio.AbortError:
                            raise
                        except asyncio.CancelledError:
                            if not readiness.stopping:
                                raise
                            await context.abort(grpc.StatusCode.UNAVAILABLE, "server stopping")
                        except Exception as exc:
                            await fail(exc, context)
                        yield item

            return call

        return rewrap(handler, unary, stream)


# --- readiness ---


#: Health service name answering SERVING while the process is alive (for
#: liveness probes), whatever its dependencies.
LIVENESS = "flagella.liveness"


class Readiness:
    """SERVING once the service has started and every named condition holds
    (e.g. "etcd"); NOT_SERVING otherwise, and for good once stopping."""

    def __init__(self, servicer: health.aio.HealthServicer) -> None:
        self.servicer = servicer
        self._names = [""]
        self._started = False
        self._stopping = False
        self._failing: dict[str, str] = {}
        self._lock = asyncio.Lock()
        # The streams being answered now: a stream never ends by itself,
        # so stopping ends them (UNAVAILABLE: the client resumes elsewhere)
        # instead of letting each hold the whole shutdown grace.
        self._streams: set[StreamAnswer] = set()

    @contextlib.contextmanager
    def stream(self) -> Iterator[StreamAnswer]:
        """Around a streaming call's answer (in the call's own task)."""
        task = asyncio.current_task()
        assert task is not None
        answer = StreamAnswer(task)
        self._streams.add(answer)
        try:
            yield answer
        finally:
            self._streams.discard(answer)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def add_services(self, service_names: Sequence[str]) -> None:
        self._names.extend(service_names)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def serving(self) -> bool:
        return self._started and not self._stopping and not self._failing

    @property
    def reasons(self) -> dict[str, str]:
        return dict(self._failing)

    async def publish(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._names:
            await self.servicer.set(name, status)
        # Liveness: the process answers and is not shutting down. A missing
        # dependency (etcd away) is a readiness matter, not a reason to restart.
        await self.servicer.set(
            LIVENESS,
            health_pb2.HealthCheckResponse.NOT_SERVING
            if self._stopping
            else health_pb2.HealthCheckResponse.SERVING,
        )

    async def set_condition(self, name: str, ok: bool, reason: str = "") -> None:
        async with self._lock:
            before = self.serving
            if ok:
                self._failing.pop(name, None)
            else:
                self._failing[name] = reason or "failing"
            if self.serving != before:
                log.info(
                    "readiness changed",
                    extra={"serving": self.serving, "condition": name, "reason": reason},
                )
            await self.publish()

    async def set_started(self) -> None:
        async with self._lock:
            self._started = True
            await self.publish()
        log.info("ready", extra={"serving": self.serving, "failing": self._failing})

    async def set_stopping(self) -> None:
        async with self._lock:
            self._stopping = True
            await self.servicer.enter_graceful_shutdown()

    async def end_streams(self, timeout: float) -> None:
        """Ends the streams being answered (each client gets UNAVAILABLE),
        waiting up to timeout seconds. A stream is cancelled only while it
        waits for its next message in our code (gRPC drops a call whose
        task is cancelled inside its own write, sending no status); one
        that is writing sees `stopping` before it waits again. Cancelled
        again until it ends: a cancellation can be lost inside
        asyncio.wait_for (Python 3.11) when its timeout fires at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and (left := deadline - loop.time()) > 0:
            for answer in list(self._streams):
                answer.cancel_if_waiting()
            await asyncio.wait([a.task for a in self._streams], timeout=min(0.1, left))


class StreamAnswer:
    """One streaming call being answered: its task, and whether it is
    waiting for its next message (the only moment it may be cancelled)."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self._waiting = False

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False

    def cancel_if_waiting(self) -> None:
        if self._waiting:
            self.task.cancel("server stopping")


class Probes:
    """Background checks of dependencies that gate readiness: a dependency
    that goes away makes the service NOT_SERVING until it is back."""

    def __init__(self, readiness: Readiness, tasks: TaskGroup | None = None) -> None:
        self.readiness = readiness
        self.tasks = tasks or TaskGroup("probes")

    def add(
        self, name: str, check: Callable[[], Awaitable[object]], *, interval: float = 2.0
    ) -> None:
        """Run check() every interval as readiness condition `name`; a
        FlagellaError (e.g. Unavailable) marks it failing."""
        self.tasks.spawn(f"probe-{name}", self._run(name, check, interval))

    async def _run(
        self, name: str, check: Callable[[], Awaitable[object]], interval: float
    ) -> None:
        while True:
            try:
                await check()
            except FlagellaError as exc:
                await self.readiness.set_condition(name, False, exc.details)
            else:
                await self.readiness.set_condition(name, True)
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        await self.tasks.stop()


# --- the service plug ---


@dataclass
class Runtime(Generic[C]):
    """What the bootstrap hands to a service."""

    name: str
    config: C
    tracing: Tracing
    readiness: Readiness
    environ: Mapping[str, str]
    # The service's background tasks: stopped after the server, before
    # the service's own stop().
    tasks: TaskGroup = field(default_factory=lambda: TaskGroup("runtime"))
    # This process's certificate files; None only with --insecure.
    tls: tls.TlsFiles | None = None
    # This process's etcd client certificate files; None with --etcd-insecure.
    etcd_tls: TlsFiles | None = None
    # Who may call what; a service that owns scoped resources registers
    # their resolvers (authz.node_of) here.
    authorizer: Authorizer = field(default_factory=Authorizer)
    # This process's Prometheus metrics; services add their own to its registry.
    metrics: Metrics = field(default_factory=lambda: Metrics("flagella"))
    # Its last warnings and errors (GetDebuginfo).
    recent_errors: RecentRecords = field(default_factory=RecentRecords)
    _channels: list[grpc.aio.Channel] = field(default_factory=list)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Times one start-up phase of the service as
        flagella_bootstrap_seconds{phase=name} (outcome failure when the
        block raises): `with runtime.phase("restore"): await ...`. The
        bootstrap times its own (config, tls, listen, start, serving)."""
        return self.metrics.bootstrap.phase(name)

    def phase_ends_with(self, name: str, done: Awaitable[object]) -> None:
        """Times a phase that goes on after start() returned (a table's
        first read, in the background): it ends when `done` does; a stop
        before then records it as failure."""

        async def timed() -> None:
            with self.phase(name):
                await done

        self.tasks.spawn(f"phase-{name}", timed())

    async def etcd_connected(self, client: Etcd) -> None:
        """Waits for etcd, timed as the phase etcd_connect."""
        with self.phase("etcd_connect"):
            await client.wait_connected()

    def debuginfo(self, **extra_versions: str) -> Debuginfo:
        """What the service's GetDebuginfo answers besides its own state."""
        return Debuginfo(self.name, self.config, self.recent_errors, extra_versions)

    @property
    def keepalive(self) -> Keepalive:
        """This cluster's keepalive agreement (flagella.common.keepalive)."""
        return Keepalive(self.config.grpc_keepalive_time)

    def channel(self, address: str, service: str = "") -> grpc.aio.Channel:
        """A client channel to a peer service (one address or its replicas':
        flagella.common.addresses; service: its name, which the replicas'
        certificates carry), traced, presenting this service's certificate
        (the latest files) and checking the peer's against the CA; closed
        on shutdown."""
        peer = addresses.target(address, service)
        options = [
            *addresses.channel_options(peer),
            *self.keepalive.client_options(),
        ]
        interceptors = [*self.metrics.client_interceptors(), *self.tracing.client_interceptors()]
        ch: grpc.aio.Channel
        if self.tls is None:
            ch = grpc.aio.insecure_channel(peer.target, interceptors=interceptors, options=options)
        else:
            ch = tls.secure_channel(
                peer.target, self.tls, options=options, interceptors=interceptors
            )
        self._channels.append(ch)
        return ch

    def etcd(self) -> Etcd:
        """A client of the configured etcd, as this service's etcd user."""
        cfg = self.config
        return Etcd(
            cfg.etcd_endpoints,
            timeout=cfg.etcd_timeout,
            tls_files=self.etcd_tls,
            interceptors=[self.metrics.kvstore.interceptor()],
        )

    async def close_channels(self) -> None:
        for ch in self._channels:
            with contextlib.suppress(Exception):
                await ch.close()
        self._channels.clear()


class App(Protocol):
    """A flagella service as the bootstrap runs it."""

    @property
    def service_names(self) -> Sequence[str]:
        """Full names of the gRPC services it serves (health, reflection)."""

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicers to the server."""

    async def start(self) -> None:
        """Connect to dependencies and restore state; return when ready to
        serve. May wait (e.g. for etcd); raise FatalError to give up."""

    async def stop(self) -> None:
        """Release what start() acquired (after the server stopped)."""


def add_port(server: grpc.aio.Server, address: str, files: tls.TlsFiles | None) -> None:
    """Listen on address: mutual TLS, or plaintext when files is None."""
    if address.startswith("unix:"):
        # A stale socket from a crashed run would make the bind fail.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address[len("unix:") :])
        os.makedirs(os.path.dirname(address[len("unix:") :]) or ".", exist_ok=True)
    try:
        if files is None:
            server.add_insecure_port(address)
        else:
            server.add_secure_port(address, tls.server_credentials(files))
    except RuntimeError as exc:
        raise FatalError(f"cannot listen on {address}: {exc}") from exc


async def health_server(
    address: str, servicer: health.aio.HealthServicer, keepalive: Keepalive
) -> grpc.aio.Server:
    """grpc.health.v1.Health alone, in plaintext: for Kubernetes probes,
    which cannot present a certificate. It tells SERVING or NOT_SERVING and
    nothing else, so it needs no authentication."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *keepalive.server_options()])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    add_port(server, address, None)
    await server.start()
    return server


def _memory_snapshots(loop: asyncio.AbstractEventLoop) -> None:
    """A debugging aid, off unless FLAGELLA_TRACEMALLOC names a file prefix:
    trace Python allocations from start (tracemalloc, 16 frames unless
    FLAGELLA_TRACEMALLOC_FRAMES says) and write
    a snapshot to <prefix>.<pid>.<n> on each SIGUSR2 (docs/DEVELOPMENT.md:
    finding memory growth in a soak)."""
    prefix = os.environ.get("FLAGELLA_TRACEMALLOC", "")
    if not prefix:
        return
    import gc
    import tracemalloc

    # Fewer frames cost less (FLAGELLA_TRACEMALLOC_FRAMES=1 keeps a soak's
    # pace while showing the allocating lines).
    tracemalloc.start(int(os.environ.get("FLAGELLA_TRACEMALLOC_FRAMES", "16")))
    taken = [0]

    def dump() -> None:
        gc.collect()
        taken[0] += 1
        path = f"{prefix}.{os.getpid()}.{taken[0]}"
        tracemalloc.take_snapshot().dump(path)
        log.warning("tracemalloc snapshot written", extra={"path": path})

    loop.add_signal_handler(signal.SIGUSR2, dump)


async def serve(runtime: Runtime[C], service: App) -> None:
    cfg = runtime.config
    auth = [] if runtime.tls is None else [AuthInterceptor(runtime.authorizer)]
    server = grpc.aio.server(
        interceptors=[
            runtime.metrics.server_interceptor(),
            *runtime.tracing.server_interceptors(),
            *auth,
            ErrorInterceptor(runtime.readiness),
        ],
        options=[("grpc.so_reuseport", 0), *runtime.keepalive.server_options()],
    )
    runtime.readiness.add_services(service.service_names)
    health_pb2_grpc.add_HealthServicer_to_server(runtime.readiness.servicer, server)
    service.register(server)
    reflection.enable_server_reflection(
        [*service.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    await runtime.readiness.publish()
    with runtime.phase("listen"):
        for address in (cfg.listen, *cfg.extra_listen):
            add_port(server, address, runtime.tls)
        await server.start()
        probes = (
            await health_server(cfg.health_listen, runtime.readiness.servicer, runtime.keepalive)
            if cfg.health_listen
            else None
        )
        metrics_server = MetricsServer(runtime.metrics, cfg.metrics_listen)
        if cfg.metrics_listen:
            try:
                await metrics_server.start()
            except OSError as exc:
                raise FatalError(f"cannot serve metrics on {cfg.metrics_listen}: {exc}") from exc
    log.info(
        "listening",
        extra={
            "address": [cfg.listen, *cfg.extra_listen],
            "health_address": cfg.health_listen or None,
            "metrics_address": cfg.metrics_listen or None,
            "mtls": runtime.tls is not None,
            "identity": runtime.tls.current.identity.uri if runtime.tls else None,
            "pid": os.getpid(),
        },
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _memory_snapshots(loop)

    async def start() -> None:
        with runtime.phase("start"):
            await service.start()

    start_task = asyncio.create_task(start(), name="service-start")
    stop_task = asyncio.create_task(stop.wait(), name="stop-signal")
    try:
        await asyncio.wait({start_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if start_task.done():
            start_task.result()  # raises FatalError
            await runtime.readiness.set_started()
            runtime.metrics.bootstrap.serving()
            await stop_task
        log.info("stopping", extra={"grace_s": cfg.shutdown_grace})
    finally:
        for task in (start_task, stop_task):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await runtime.readiness.set_stopping()
        await runtime.readiness.end_streams(cfg.shutdown_grace)
        if probes is not None:
            await probes.stop(0)
        await server.stop(cfg.shutdown_grace)
        await metrics_server.stop()
        await runtime.tasks.stop()
        with contextlib.suppress(Exception):
            await service.stop()
        await runtime.close_channels()
        runtime.tracing.shutdown()
        log.info("stopped")


def load_tls(cfg: ServiceConfig, name: str) -> tls.TlsFiles | None:
    """The service's certificate files, checked; None with --insecure.
    Raises ConfigError naming the option, the file and the problem."""
    if cfg.insecure:
        return None
    return _load_files(cfg, name, "--tls", cert=cfg.tls_cert, key=cfg.tls_key, ca=cfg.tls_ca)


def load_etcd_tls(cfg: ServiceConfig, name: str) -> tls.TlsFiles | None:
    """The service's etcd client certificate files, checked as the gRPC
    ones are (from the etcd CA, naming this service); None with
    --etcd-insecure or for a service that does not use etcd."""
    if cfg.etcd_insecure or not cfg.USES_ETCD:
        return None
    return _load_files(cfg, name, "--etcd", cert=cfg.etcd_cert, key=cfg.etcd_key, ca=cfg.etcd_ca)


def _load_files(
    cfg: ServiceConfig, name: str, flag: str, *, cert: str, key: str, ca: str
) -> tls.TlsFiles:
    paths = tls.TlsPaths(Path(cert), Path(key), Path(ca))
    option_of = {
        str(paths.cert): f"{flag}-cert",
        str(paths.key): f"{flag}-key",
        str(paths.ca): f"{flag}-ca",
    }
    try:
        files = tls.TlsFiles(paths)
    except TlsFileError as exc:
        raise ConfigError(option_of.get(exc.path, f"{flag}-cert"), str(exc)) from None
    expected = cfg.tls_identity(name)
    if files.current.identity != expected:
        raise ConfigError(
            f"{flag}-cert",
            f"{paths.cert}: names {files.current.identity.uri}, but this process is {expected.uri}",
        )
    return files


def main(
    name: str,
    config_cls: type[C],
    make_service: Callable[[Runtime[C]], App],
    *,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Entry point of `python -m flagella.<name>`. Returns the exit status:
    0 after a clean stop, 2 for bad configuration, 1 when start-up failed."""
    env = dict(os.environ if environ is None else environ)
    prog = f"flagella-{name}"
    metrics = Metrics(name)
    try:
        with metrics.bootstrap.phase("config"):
            cfg = load_config(
                config_cls,
                prog=prog,
                env_prefix=f"FLAGELLA_{name.upper()}_",
                argv=sys.argv[1:] if argv is None else argv,
                environ=env,
                description=(config_cls.__doc__ or "").strip(),
            )
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        with metrics.bootstrap.phase("tls"):
            files = load_tls(cfg, name)
            etcd_files = load_etcd_tls(cfg, name)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    recent = RecentRecords()
    setup_logging(prog, cfg.log_level, recent)
    if files is None:
        log.warning(
            "INSECURE: --insecure is set: plaintext gRPC, no authentication, no authorization; "
            "anyone who reaches a port can call anything. Development only."
        )
    if cfg.USES_ETCD and etcd_files is None:
        log.warning(
            "INSECURE: --etcd-insecure is set: plaintext etcd, no client certificate. "
            "Development only."
        )

    async def run() -> None:
        runtime = Runtime(
            name=name,
            config=cfg,
            metrics=metrics,
            tracing=setup_tracing(prog, env),
            readiness=Readiness(health.aio.HealthServicer()),
            environ=env,
            tls=files,
            etcd_tls=etcd_files,
            recent_errors=recent,
        )
        await serve(runtime, make_service(runtime))

    metrics.gc_pauses.install()
    try:
        asyncio.run(run())
    except FatalError as exc:
        log.error("start-up failed", extra={"reason": str(exc)})
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        metrics.gc_pauses.uninstall()
    return 0
