"""gRPC handlers of flagella.policy.v1: proto <-> domain and validation.

The RPCs are implemented by issue #4; until then the generated base class
answers UNIMPLEMENTED.
"""

from __future__ import annotations

from flagella.api.policy.v1 import policy_pb2_grpc
from flagella.policy.service import PolicyService


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    def __init__(self, service: PolicyService) -> None:
        self.service = service
