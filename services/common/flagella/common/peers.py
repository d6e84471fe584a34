"""Calls to peer services: their gRPC errors become domain errors, so the
caller's logic (which never imports grpc) sees NotFound, Unavailable ... and
its own callers get a status that says which peer failed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from flagella.common import errors

_BY_CODE: dict[grpc.StatusCode, type[errors.FlagellaError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.ABORTED: errors.Aborted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
}


def translate(exc: grpc.aio.AioRpcError, peer: str) -> errors.FlagellaError:
    """The domain error for a failed call to peer (e.g. "ipam")."""
    cls = _BY_CODE.get(exc.code(), errors.Unavailable)
    return cls(f"{peer}: {exc.details() or exc.code().name}")


@contextlib.contextmanager
def calling(peer: str) -> Iterator[None]:
    """with calling("ipam"): await stub.Allocate(...)"""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise translate(exc, peer) from exc
