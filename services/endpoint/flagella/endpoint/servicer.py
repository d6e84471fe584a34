"""gRPC handlers of flagella.endpoint.v1: proto <-> domain and validation.

The RPCs are implemented by issue #6; until then the generated base class
answers UNIMPLEMENTED.
"""

from __future__ import annotations

from flagella.api.endpoint.v1 import endpoint_pb2_grpc
from flagella.endpoint.service import EndpointService


class EndpointServicer(endpoint_pb2_grpc.EndpointServiceServicer):
    def __init__(self, service: EndpointService) -> None:
        self.service = service
