"""gRPC handlers of flagella.lb.v1: proto <-> domain and validation.

The RPCs are implemented by issue #7; until then the generated base class
answers UNIMPLEMENTED.
"""

from __future__ import annotations

from flagella.api.lb.v1 import lb_pb2_grpc
from flagella.lb.service import LbService


class LbServicer(lb_pb2_grpc.LoadBalancerServiceServicer):
    def __init__(self, service: LbService) -> None:
        self.service = service
