"""Typed configuration from flags and environment, failing fast.

A service's configuration is a frozen dataclass. Each field is an option:
flag ``--field-name``, environment ``FLAGELLA_<SVC>_FIELD_NAME``, then the
cluster-wide ``FLAGELLA_FIELD_NAME``, then the default; flags win. Types are
str, int, float, bool and tuple[str, ...] (repeat the flag or separate by
commas). A field's ``parse`` checks and converts one value; ``validate()``
checks the whole. Any problem raises ConfigError, which the bootstrap prints as
one line before exiting with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, TypeVar

from flagella.common.errors import ConfigError
from flagella.common.pki import Identity
from flagella.common.sync.table import WATCH_LOG_SIZE

T = TypeVar("T", bound="ServiceConfig")
Parser = Callable[[str], Any]


def option(
    default: Any,
    help: str,
    *,
    parse: Parser | None = None,
    choices: Sequence[str] | None = None,
) -> Any:
    """A config field: its default, help text and optional per-value parser."""
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


def parse_host_port(value: str) -> str:
    """host:port with a port in 1..65535, or unix:PATH."""
    if value.startswith("unix:"):
        if len(value) <= len("unix:"):
            raise ValueError("unix: needs a socket path")
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not host:port")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} has no valid port (0-65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"{value!r} has an empty host")
    return value


def parse_cidr(value: str) -> str:
    """A network in CIDR notation, host bits zero (10.0.0.0/8, fd00::/104)."""
    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a valid CIDR ({exc})") from None
    return str(net)


def parse_ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{value!r} is not a valid IP address") from None


@dataclass(frozen=True)
class ServiceConfig:
    """Options every service has."""

    #: Whether the service keeps state in etcd (the datapath does not): only
    #: then are the etcd certificate files required at start.
    USES_ETCD: ClassVar[bool] = True

    listen: str = option("127.0.0.1:50050", "gRPC address to serve on", parse=parse_host_port)
    extra_listen: tuple[str, ...] = option(
        (),
        "more addresses to serve on, e.g. unix:/run/flagella/endpoint.sock",
        parse=parse_host_port,
    )
    etcd_endpoints: tuple[str, ...] = option(
        ("127.0.0.1:2379",),
        "etcd client endpoints (host:port, comma-separated)",
        parse=parse_host_port,
    )
    etcd_timeout: float = option(5.0, "timeout of one etcd request, seconds")
    etcd_cert: str = option(
        "/etc/flagella/etcd-tls/tls.crt",
        "client certificate (PEM) for etcd, from the etcd CA; its CN is the etcd user",
    )
    etcd_key: str = option("/etc/flagella/etcd-tls/tls.key", "the etcd certificate's key (PEM)")
    etcd_ca: str = option(
        "/etc/flagella/etcd-tls/ca.crt", "the etcd CA (PEM): etcd's server certificate is from it"
    )
    etcd_insecure: bool = option(
        False, "DEVELOPMENT ONLY: plaintext etcd with no client certificate (etcd auth off)"
    )
    grpc_keepalive_time: float = option(
        20.0,
        "seconds a gRPC connection to a peer may be silent before a ping; servers accept "
        "pings at half this: set it cluster-wide (FLAGELLA_GRPC_KEEPALIVE_TIME)",
    )
    watch_history: int = option(
        WATCH_LOG_SIZE,
        "changes each table served to watches keeps: a watch that reconnects resumes from "
        "its revision while they reach back, else it gets a full snapshot",
    )
    log_level: str = option("info", "log level", choices=("debug", "info", "warning", "error"))
    shutdown_grace: float = option(5.0, "seconds in-flight calls get to finish on SIGTERM")
    tls_cert: str = option(
        "/etc/flagella/tls/tls.crt", "this service's certificate (PEM), shown to callers and peers"
    )
    tls_key: str = option("/etc/flagella/tls/tls.key", "the certificate's private key (PEM)")
    tls_ca: str = option(
        "/etc/flagella/tls/ca.crt", "the cluster CA (PEM): callers and peers must be issued by it"
    )
    insecure: bool = option(
        False,
        "DEVELOPMENT ONLY: plaintext gRPC with no authentication or authorization",
    )
    metrics_listen: str = option(
        "127.0.0.1:9960",
        "serve Prometheus metrics (GET /metrics, HTTP) here; empty: off",
        parse=parse_host_port,
    )
    health_listen: str = option(
        "",
        "also serve grpc.health.v1.Health alone, in plaintext, here (for Kubernetes probes)",
        parse=parse_host_port,
    )

    def tls_identity(self, service: str) -> Identity:
        """Who this process is: its certificate must name this identity."""
        return Identity("service", service)

    def validate(self) -> None:
        """Cross-field checks; raise ConfigError."""
        if self.etcd_timeout <= 0:
            raise ConfigError("--etcd-timeout", "must be positive")
        if self.grpc_keepalive_time <= 0:
            raise ConfigError("--grpc-keepalive-time", "must be positive")
        if not 256 <= self.watch_history <= 1 << 20:
            raise ConfigError("--watch-history", "must be within 256..1048576")
        if self.shutdown_grace < 0:
            raise ConfigError("--shutdown-grace", "must not be negative")
        if self.metrics_listen.startswith("unix:"):
            raise ConfigError("--metrics-listen", "metrics are served over TCP (host:port)")


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError("arguments", message)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(opt: str, raw: str, typ: Any, meta: Mapping[str, Any]) -> Any:
    parse: Parser | None = meta.get("parse")
    choices: Sequence[str] | None = meta.get("choices")
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"{raw!r} is not a boolean")
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        if choices is not None and raw not in choices:
            raise ValueError(f"{raw!r} is not one of {', '.join(choices)}")
        return parse(raw) if parse else raw
    except ValueError as exc:
        raise ConfigError(opt, str(exc)) from None


def load_config(
    cls: type[T],
    *,
    prog: str,
    env_prefix: str,
    argv: Sequence[str],
    environ: Mapping[str, str],
    description: str = "",
) -> T:
    """Build and validate ``cls`` from argv and environ. Raises ConfigError."""
    hints = typing.get_type_hints(cls)
    parser = _OneLineParser(prog=prog, description=description)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    for f in fields:
        typ = hints[f.name]
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help", "")}
        if typ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(typ) is tuple:
            kwargs["action"] = "append"
        parser.add_argument(_flag(f.name), default=None, **kwargs)
    ns = parser.parse_args(list(argv))

    values: dict[str, Any] = {}
    for f in fields:
        typ = hints[f.name]
        flag_value = getattr(ns, f.name)
        env_names = (f"{env_prefix}{f.name.upper()}", f"FLAGELLA_{f.name.upper()}")
        env_value = next((environ[n] for n in env_names if n in environ), None)
        if flag_value is None and env_value is None:
            continue
        opt = (
            _flag(f.name) if flag_value is not None else next(n for n in env_names if n in environ)
        )
        if typing.get_origin(typ) is tuple:
            raw_items = flag_value if flag_value is not None else [env_value]
            items = [p.strip() for raw in raw_items for p in str(raw).split(",") if p.strip()]
            values[f.name] = tuple(_convert(opt, item, str, f.metadata) for item in items)
        elif typ is bool and isinstance(flag_value, bool):
            values[f.name] = flag_value
        else:
            raw = flag_value if flag_value is not None else env_value
            values[f.name] = _convert(opt, str(raw), typ, f.metadata)
    cfg = cls(**values)
    cfg.validate()
    return cfg
