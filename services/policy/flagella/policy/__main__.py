"""python -m flagella.policy: run the policy service."""

from __future__ import annotations

import sys

import grpc

from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common.etcd import Etcd
from flagella.common.server import Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.policy.config import PolicyConfig
from flagella.policy.service import PolicyService
from flagella.policy.servicer import PolicyServicer
from flagella.policy.store import PolicyStore


class PolicyApp:
    service_names = (policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name,)

    def __init__(self, runtime: Runtime[PolicyConfig]) -> None:
        cfg = runtime.config
        self.etcd = Etcd(cfg.etcd_endpoints, timeout=cfg.etcd_timeout)
        self.probes = Probes(runtime.readiness)
        self.service = PolicyService(PolicyStore(self.etcd))

    def register(self, server: grpc.aio.Server) -> None:
        policy_pb2_grpc.add_PolicyServiceServicer_to_server(
            PolicyServicer(self.service),  # type: ignore[abstract]  # RPCs land with their issue
            server,
        )

    async def start(self) -> None:
        await self.etcd.wait_connected()
        self.probes.add("etcd", self.etcd.current_revision)

    async def stop(self) -> None:
        await self.probes.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("policy", PolicyConfig, PolicyApp)


if __name__ == "__main__":
    sys.exit(main())
