"""gRPC handlers of flagella.ipam.v1: proto <-> domain and validation.

The RPCs are implemented by issue #3; until then the generated base class
answers UNIMPLEMENTED.
"""

from __future__ import annotations

from flagella.api.ipam.v1 import ipam_pb2_grpc
from flagella.ipam.service import IpamService


class IpamServicer(ipam_pb2_grpc.IpamServiceServicer):
    def __init__(self, service: IpamService) -> None:
        self.service = service
