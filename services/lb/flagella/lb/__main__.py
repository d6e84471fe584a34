"""python -m flagella.lb: run the lb service."""

from __future__ import annotations

import sys

import grpc

from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.common.backoff import retry
from flagella.common.errors import Unavailable
from flagella.common.leader import Election
from flagella.common.server import FatalError, Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.lb.bgpk8s import BgpKubeWatcher
from flagella.lb.bgpstore import BgpPolicyStore
from flagella.lb.config import LbConfig
from flagella.lb.k8s import WATCH_TIMEOUT_S, KubernetesWatcher
from flagella.lb.lbipam_store import LbIpam
from flagella.lb.lbpoolk8s import PoolKubeWatcher
from flagella.lb.lrpk8s import LrpKubeWatcher
from flagella.lb.lrpstore import LrpStore
from flagella.lb.metrics import LbCollector
from flagella.lb.service import LbService
from flagella.lb.servicer import LbServicer
from flagella.lb.store import LbStore, SeedMismatch


class LbApp:
    service_names = (lb_pb2.DESCRIPTOR.services_by_name["LoadBalancerService"].full_name,)

    def __init__(self, runtime: Runtime[LbConfig]) -> None:
        cfg = runtime.config
        self.runtime = runtime
        self.config = cfg
        self.tasks = runtime.tasks
        self.etcd = runtime.etcd()
        self.probes = Probes(runtime.readiness, runtime.tasks)
        history = cfg.watch_history
        self.store = LbStore(self.etcd, watch_history=history)
        self.lrps = LrpStore(self.etcd, watch_history=history)
        self.bgp = BgpPolicyStore(self.etcd, watch_history=history)
        self.service = LbService(
            self.store, cfg.limits, cfg.seed, cache_slots=cfg.table_cache_slots
        )
        runtime.metrics.registry.register(LbCollector(self.store.services))
        self.ipam = LbIpam(self.etcd, self.service.set_external)
        self.k8s: KubernetesWatcher | None = None

    def register(self, server: grpc.aio.Server) -> None:
        lb_pb2_grpc.add_LoadBalancerServiceServicer_to_server(
            LbServicer(
                self.service,
                self.config.limits,
                self.lrps,
                heartbeat=self.config.watch_heartbeat,
                debuginfo=self.runtime.debuginfo(),
                ipam=self.ipam,
                bgp=self.bgp,
            ),
            server,
        )

    async def start(self) -> None:
        await self.runtime.etcd_connected(self.etcd)
        try:
            await retry(
                lambda: self.store.ensure_seed(self.config.maglev_hash_seed),
                what="recording the Maglev seed",
                retry_on=(Unavailable,),
            )
        except SeedMismatch as exc:
            raise FatalError(str(exc)) from exc
        self.probes.add("etcd", self.etcd.connect)
        self.tasks.spawn("services-table", self.store.run())
        self.tasks.spawn("lrps-table", self.lrps.run())
        self.tasks.spawn("bgp-policies-table", self.bgp.run())
        self.runtime.phase_ends_with("first_sync", self.store.services.wait_initialized())
        if self.config.kubeconfig:
            self.k8s = KubernetesWatcher(
                self.service,
                self.config.kubeconfig,
                self.config.limits,
                LrpKubeWatcher(self.lrps, watch_timeout=WATCH_TIMEOUT_S),
                ipam=self.ipam,
                pools=PoolKubeWatcher(self.ipam, watch_timeout=WATCH_TIMEOUT_S),
                bgp=BgpKubeWatcher(
                    self.bgp, self.config.bgp_secrets_namespace, watch_timeout=WATCH_TIMEOUT_S
                ),
            )
            await self.k8s.start(self.tasks, Election.of(self.config))

    async def stop(self) -> None:
        # The runtime's tasks (probes, watches) have stopped by now.
        if self.k8s is not None:
            await self.k8s.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("lb", LbConfig, LbApp)


if __name__ == "__main__":
    sys.exit(main())
