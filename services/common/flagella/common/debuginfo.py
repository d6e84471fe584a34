"""Each service's part of `flagella debuginfo` (GetDebuginfo): its options
as parsed with secrets left out, versions, its own state and its last
warnings and errors. Every service answers for itself, with the state it
owns; the CLI asks each and assembles the one document (no service asks
another).

Left out of the configuration: the value of any option whose name says it
is a secret (password, secret, token, credential) and the user and password
inside a URL; the contents of key files are never read (their paths are
shown)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TypeVar

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from flagella.common.config import ServiceConfig
from flagella.common.errors import Unavailable
from flagella.common.logs import RecentRecords

M = TypeVar("M", bound=Message)

REDACTED = "<redacted>"
_SECRET_NAMES = ("password", "secret", "token", "credential")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
# Distributions whose versions a report names (those installed).
LIBRARIES = (
    "grpcio",
    "protobuf",
    "aetcd",
    "pyroute2",
    "prometheus-client",
    "opentelemetry-sdk",
    "kubernetes",
    "cryptography",
)


def config_document(cfg: ServiceConfig) -> tuple[dict[str, Any], list[str]]:
    """The options as parsed (JSON values), and what was left out of them."""
    out: dict[str, Any] = {}
    redacted: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if any(word in f.name for word in _SECRET_NAMES):
            out[f.name] = REDACTED
            redacted.append(f"{f.name}: its value (a secret)")
            continue
        if f.name.endswith("_key"):
            redacted.append(f"{f.name}: the key file's contents (never read; its path is shown)")
        values = list(value) if isinstance(value, tuple) else [value]
        cleaned = [
            _URL_USERINFO.sub(r"\g<scheme>" + REDACTED + "@", v) if isinstance(v, str) else v
            for v in values
        ]
        if cleaned != values:
            redacted.append(f"{f.name}: the user and password of a URL")
        out[f.name] = cleaned if isinstance(value, tuple) else cleaned[0]
    return out, redacted


def versions(service: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """flagella's (the service's distribution), Python's, the kernel's and
    the libraries' installed."""
    out = {"python": platform.python_version(), "kernel": platform.release()}
    for dist in (f"flagella-{service}", "flagella-common", *LIBRARIES):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    out.update(extra or {})
    return out


def to_json(value: Any) -> Any:
    """value as JSON would carry it (messages as their JSON mapping)."""
    if isinstance(value, Message):
        return MessageToDict(value, preserving_proto_field_name=True)
    return json.loads(json.dumps(value, default=str))


class _Record(Protocol):
    """The DebugLogRecord of any service's proto."""

    time: Any
    level: str
    logger: str
    message: str
    fields: Any


class Debuginfo:
    """What a service's GetDebuginfo answers besides its own state."""

    def __init__(
        self,
        service: str,
        config: ServiceConfig,
        recent: RecentRecords,
        extra_versions: Mapping[str, str] | None = None,
    ) -> None:
        self.service = service
        self.config = config
        self.recent = recent
        self.extra_versions = dict(extra_versions or {})

    def fill(self, message: M, state: Mapping[str, Any]) -> M:
        """message (the service's Debuginfo) filled: state is the
        service's own (JSON values or messages)."""
        config, redacted = config_document(self.config)
        msg: Any = message
        msg.service = self.service
        msg.config.update(config)
        msg.redacted.extend(redacted)
        msg.versions.update(versions(self.service, self.extra_versions))
        msg.state.update({k: to_json(v) for k, v in state.items()})
        _add_records(msg.recent_errors, list(self.recent.records))
        return message


def answer(debuginfo: Debuginfo | None, message: M, state: Mapping[str, Any]) -> M:
    """A servicer's GetDebuginfo: message filled, or Unavailable in a
    process made without one (a servicer built by a test)."""
    if debuginfo is None:
        raise Unavailable("this process keeps no debuginfo")
    return debuginfo.fill(message, state)


def _add_records(out: Any, records: Iterable[Any]) -> None:
    for r in records:
        rec: _Record = out.add()
        rec.time.FromNanoseconds(int(r.time * 1e9))
        rec.level = r.level
        rec.logger = r.logger
        rec.message = r.message
        rec.fields.update(r.fields)
