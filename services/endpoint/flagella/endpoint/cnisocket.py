"""Interim: the plaintext unix socket flagella-cni reaches the endpoint
service on, until issue 13 item 5 puts the plugin behind its node's
datapath (which relays under the node's certificate).

The socket is mode 0600 (root only: as the CNI plugin runs) and serves the
CNI calls alone; every other method is PERMISSION_DENIED. Nothing here
authenticates the caller beyond the file's permissions: it is off unless
--cni-listen is given.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.common.server import ErrorInterceptor, Runtime, add_port

SERVICE = endpoint_pb2.DESCRIPTOR.services_by_name["EndpointService"].full_name
CNI_METHODS = frozenset(
    f"/{SERVICE}/{name}"
    for name in ("CreateEndpoint", "DeleteEndpoint", "CheckEndpoint", "GarbageCollect", "GetStatus")
)


class CniOnly(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        method = handler_call_details.method
        if method in CNI_METHODS:
            return await continuation(handler_call_details)

        async def deny(request: Any, context: Any) -> None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"the CNI socket serves no {method}"
            )

        return grpc.unary_unary_rpc_method_handler(deny)


async def serve_cni_socket(
    address: str, servicer: endpoint_pb2_grpc.EndpointServiceServicer, runtime: Runtime[Any]
) -> grpc.aio.Server:
    server = grpc.aio.server(
        interceptors=[
            *runtime.tracing.server_interceptors(),
            CniOnly(),
            ErrorInterceptor(runtime.readiness),
        ]
    )
    endpoint_pb2_grpc.add_EndpointServiceServicer_to_server(servicer, server)
    old = os.umask(0o077)  # no moment at which others could connect
    try:
        add_port(server, address, None)
        await server.start()
    finally:
        os.umask(old)
    os.chmod(address[len("unix:") :], 0o600)
    return server
