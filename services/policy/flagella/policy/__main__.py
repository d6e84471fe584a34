"""python -m flagella.policy: run the policy service."""

from __future__ import annotations

import sys

import grpc

from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common.kubestatus import health_report
from flagella.common.leader import Election
from flagella.common.server import FatalError, Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.policy.config import PolicyConfig
from flagella.policy.kube import KINDS, PolicyWatchers
from flagella.policy.lbservices import LbServices
from flagella.policy.metrics import PolicyCollector
from flagella.policy.service import PolicyService
from flagella.policy.servicer import PolicyServicer
from flagella.policy.settings import Settings
from flagella.policy.store import PolicyStore


def settings_of(cfg: PolicyConfig) -> Settings:
    return Settings(
        node_lease_ttl=cfg.node_lease_ttl,
        keys_per_lease=cfg.keys_per_lease,
        gc_interval=cfg.identity_gc_interval,
        budget=cfg.policy_map_max_entries,
        allow_localhost=cfg.allow_localhost == "always",
        k8s_ipblocks=cfg.k8s_ipblock_mode == "kubernetes",
        label_filter=cfg.identity_label_filter,
        watch_heartbeat=cfg.watch_heartbeat,
        watch_quiet_sync_rate=cfg.watch_quiet_sync_rate,
        wait_timeout=max(cfg.etcd_timeout * 2, 5.0),
        watch_history=cfg.watch_history,
    )


class PolicyApp:
    service_names = (policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name,)

    def __init__(self, runtime: Runtime[PolicyConfig]) -> None:
        cfg = runtime.config
        self.runtime = runtime
        self.etcd = runtime.etcd()
        self.probes = Probes(runtime.readiness)
        # toServices follows lb's services; policy starts (and is ready)
        # without lb.
        lb = LbServices(runtime.channel(cfg.lb_address, "lb")) if cfg.lb_address else None
        self.service = PolicyService(
            PolicyStore(self.etcd), settings_of(cfg), tasks=runtime.tasks, lb=lb
        )
        runtime.metrics.registry.register(PolicyCollector(self.service))
        self.kube: PolicyWatchers | None = None

    def register(self, server: grpc.aio.Server) -> None:
        policy_pb2_grpc.add_PolicyServiceServicer_to_server(
            PolicyServicer(self.service, self.runtime.debuginfo()), server
        )

    async def start(self) -> None:
        await self.runtime.etcd_connected(self.etcd)
        with self.runtime.phase("first_sync"):
            await self.service.start()
        self.probes.add("etcd", self.etcd.connect)
        cfg = self.runtime.config
        if cfg.kubeconfig:
            self.kube = PolicyWatchers(self.service.rules, cfg.kubeconfig)
            try:
                await self.kube.start(
                    self.runtime.tasks,
                    Election.of(cfg),
                    report=health_report(self.runtime.readiness),
                    kinds=[k for k in KINDS if k.kind in cfg.kubernetes_policy_kinds],
                )
            except Exception as exc:
                raise FatalError(f"cannot use --kubeconfig {cfg.kubeconfig}: {exc}") from exc

    async def stop(self) -> None:
        await self.probes.stop()
        await self.service.stop()
        if self.kube is not None:
            await self.kube.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("policy", PolicyConfig, PolicyApp)


if __name__ == "__main__":
    sys.exit(main())
