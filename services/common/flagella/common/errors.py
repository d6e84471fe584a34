"""Domain errors. Each carries the gRPC status it maps to, by name, so that
service logic raises them without importing grpc; the server bootstrap's
interceptor turns them into statuses (table in ARCHITECTURE.md)."""

from __future__ import annotations

#: The longest status message, in characters: it quotes what it refuses, and
#: gRPC carries it in a trailer, which a client drops past 16 KiB (percent-
#: encoded: up to 12 bytes a character) for RESOURCE_EXHAUSTED, not the error.
MAX_DETAILS = 1000


def bounded(text: str) -> str:
    """text, cut to MAX_DETAILS characters, saying how much was cut."""
    if len(text) <= MAX_DETAILS:
        return text
    return f"{text[:MAX_DETAILS]}... ({len(text) - MAX_DETAILS} more characters)"


def map_key(field: str, key: str) -> str:
    """The path of a map entry: `field[key]`, the key quoted when it holds
    a bracket or a quote (so the path still parses as one)."""
    if any(c in key for c in "[]'\""):
        return f"{field}[{key!r}]"
    return f"{field}[{key}]"


class FlagellaError(Exception):
    """Base of every error a caller should see as-is."""

    #: Name of the grpc.StatusCode member this error maps to.
    code = "UNKNOWN"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.message = message
        self.field = field
        super().__init__(self.details)

    @property
    def details(self) -> str:
        """The status message: the field path first, when there is one."""
        return bounded(f"{self.field}: {self.message}" if self.field else self.message)


class InvalidArgument(FlagellaError):
    """Bad input. `field` names where in the request (or document) it is."""

    code = "INVALID_ARGUMENT"


class NotFound(FlagellaError):
    code = "NOT_FOUND"


class AlreadyExists(FlagellaError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(FlagellaError):
    """The request is valid but the state forbids it (e.g. releasing an IP an
    endpoint still uses)."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(FlagellaError):
    """A pool or a map is full."""

    code = "RESOURCE_EXHAUSTED"


class Aborted(FlagellaError):
    """A revision conflict: the caller may re-read and retry."""

    code = "ABORTED"


class Unavailable(FlagellaError):
    """etcd or a peer service is down; the caller may retry."""

    code = "UNAVAILABLE"


class DeadlineExceeded(FlagellaError):
    code = "DEADLINE_EXCEEDED"


class ConfigError(Exception):
    """Bad configuration: the process exits with this one-line reason."""

    def __init__(self, option: str, message: str) -> None:
        self.option = option
        self.message = message
        super().__init__(f"invalid {option}: {message}")
