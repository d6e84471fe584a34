"""JSON logs, one object per line, carrying the current trace and span ids."""

from __future__ import annotations

import collections
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

# Attributes every LogRecord has; anything else was passed in `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            entry["trace_id"] = f"{ctx.trace_id:032x}"
            entry["span_id"] = f"{ctx.span_id:016x}"
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


@dataclass(frozen=True)
class RecentRecord:
    time: float
    level: str
    logger: str
    message: str
    fields: dict[str, str]


class RecentRecords(logging.Handler):
    """The last `capacity` records at WARNING or above, for GetDebuginfo's
    recent errors: each cut short (message 1,000 characters, an extra field
    200), so the ring stays under ~0.2 MB whatever is logged."""

    def __init__(self, capacity: int = 100) -> None:
        super().__init__(logging.WARNING)
        self.records: collections.deque[RecentRecord] = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        fields = {
            k: str(v)[:200]
            for k, v in vars(record).items()
            if k not in _RECORD_ATTRS and not k.startswith("_")
        }
        if record.exc_info and record.exc_info[1] is not None:
            fields["exc"] = repr(record.exc_info[1])[:200]
        self.records.append(
            RecentRecord(
                record.created,
                record.levelname.lower(),
                record.name,
                record.getMessage()[:1000],
                fields,
            )
        )


def setup_logging(service: str, level: str, recent: RecentRecords | None = None) -> None:
    """Route every logger to stderr as JSON lines (and those at WARNING or
    above to recent, when given)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler, *([recent] if recent is not None else [])]
    root.setLevel(level.upper())
    # grpc and etcd client internals are noisy at debug.
    for noisy in ("grpc", "aetcd", "urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))
