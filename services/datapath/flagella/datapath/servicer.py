"""gRPC handlers of flagella.datapath.v1: proto <-> domain and validation.

The RPCs are implemented by issue #5; until then the generated base class
answers UNIMPLEMENTED.
"""

from __future__ import annotations

from flagella.api.datapath.v1 import datapath_pb2_grpc
from flagella.datapath.service import DatapathService


class DatapathServicer(datapath_pb2_grpc.DatapathServiceServicer):
    def __init__(self, service: DatapathService) -> None:
        self.service = service
