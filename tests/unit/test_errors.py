"""Domain errors map to gRPC status codes with the field named first."""

from __future__ import annotations

import grpc
import pytest

from flagella.common import errors
from flagella.common.server import status_of


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidArgument("bad", field="cidr"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("no node n1", field="node"), grpc.StatusCode.NOT_FOUND),
        (errors.AlreadyExists("x"), grpc.StatusCode.ALREADY_EXISTS),
        (errors.FailedPrecondition("in use"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Aborted("conflict"), grpc.StatusCode.ABORTED),
        (errors.Unavailable("etcd down"), grpc.StatusCode.UNAVAILABLE),
        (errors.DeadlineExceeded("slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (NotImplementedError(), grpc.StatusCode.UNIMPLEMENTED),
        (KeyError("secret detail"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_codes(exc: BaseException, code: grpc.StatusCode) -> None:
    assert status_of(exc)[0] == code


def test_messages_name_the_field_and_hide_internals() -> None:
    assert status_of(errors.InvalidArgument("'10.0/8' is not a CIDR", field="cidr"))[1] == (
        "cidr: '10.0/8' is not a CIDR"
    )
    assert status_of(errors.NotFound("no such node"))[1] == "no such node"
    assert status_of(KeyError("secret detail"))[1] == "internal error"
