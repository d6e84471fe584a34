"""python -m flagella.datapath: run the datapath service of this node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common.errors import FlagellaError
from flagella.common.server import FatalError, Runtime
from flagella.common.server import main as serve_main
from flagella.datapath.config import DatapathConfig
from flagella.datapath.follow import StreamFollower
from flagella.datapath.handlers import IPCacheHandler, PolicyHandler, ServicesHandler
from flagella.datapath.node import NodeRegistration
from flagella.datapath.routes import NodeRoutesHandler
from flagella.datapath.service import DatapathService
from flagella.datapath.servicer import DatapathServicer

log = logging.getLogger(__name__)


class DatapathApp:
    service_names = (datapath_pb2.DESCRIPTOR.services_by_name["DatapathService"].full_name,)

    def __init__(self, runtime: Runtime[DatapathConfig]) -> None:
        self.runtime = runtime
        self.service = DatapathService(runtime.config)
        self.registration: NodeRegistration | None = None
        self.followers: list[StreamFollower] = []
        self._tasks: list[asyncio.Task[None]] = []

    def register(self, server: grpc.aio.Server) -> None:
        datapath_pb2_grpc.add_DatapathServiceServicer_to_server(
            DatapathServicer(self.service), server
        )

    def _task(self, coro: object, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))  # type: ignore[arg-type]

    async def start(self) -> None:
        cfg = self.runtime.config
        try:
            await self.service.start()
        except FlagellaError as exc:
            raise FatalError(exc.details) from exc
        except OSError as exc:
            raise FatalError(f"cannot load the BPF datapath: {exc}") from exc
        self._task(self._gc(cfg.gc_interval_seconds), "bpf-gc")
        tracer = self.runtime.tracing.tracer("flagella.datapath")
        if cfg.ipam_address:
            ipam = ipam_pb2_grpc.IpamServiceStub(self.runtime.channel(cfg.ipam_address))
            request = ipam_pb2.RegisterNodeRequest(
                name=cfg.node_name,
                addresses=[
                    ipam_pb2.NodeAddress(type=ipam_pb2.NodeAddress.TYPE_INTERNAL_IP, ip=ip)
                    for ip in cfg.node_ip
                ],
                datapath_address=cfg.advertise_address or cfg.listen,
            )
            self.registration = NodeRegistration(
                ipam, request, tracer, on_registered=self.service.set_node
            )
            self._task(self.registration.run(), "node-registration")
            self._follow(
                "nodes",
                lambda since: ipam.WatchNodes(ipam_pb2.WatchNodesRequest(since_revision=since)),
                NodeRoutesHandler(cfg.node_name, self.service.routes),
            )
        if cfg.policy_address:
            policy = policy_pb2_grpc.PolicyServiceStub(self.runtime.channel(cfg.policy_address))
            self._follow(
                "ipcache",
                lambda since: policy.WatchIPCache(
                    policy_pb2.WatchIPCacheRequest(since_revision=since)
                ),
                IPCacheHandler(self.service.ipcache),
            )
            self._follow(
                "policy",
                lambda since: policy.WatchPolicy(
                    policy_pb2.WatchPolicyRequest(node=cfg.node_name, since_revision=since)
                ),
                PolicyHandler(self.service),
            )
        if cfg.lb_address:
            lb = lb_pb2_grpc.LoadBalancerServiceStub(self.runtime.channel(cfg.lb_address))
            self._follow(
                "services",
                lambda since: lb.WatchServices(
                    lb_pb2.WatchServicesRequest(since_revision=since, include_maglev_tables=True)
                ),
                ServicesHandler(self.service, cfg.node_ip),
            )
        if self.registration is not None:
            # Not ready before the node is registered: its pod CIDRs come from ipam.
            await self.registration.registered.wait()

    def _follow(self, name: str, open_stream: object, handler: object) -> None:
        follower = StreamFollower(name, open_stream, handler)  # type: ignore[arg-type]
        self.service.streams_synced.setdefault(name, False)
        self.followers.append(follower)
        self._task(self._run_follower(follower), f"follow-{name}")

    async def _run_follower(self, follower: StreamFollower) -> None:
        task = asyncio.create_task(follower.run(), name=f"stream-{follower.name}")
        try:
            await follower.synced.wait()
            self.service.streams_synced[follower.name] = True
            await task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _gc(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.service.prune_vanished()
                ct, nat = await self.service.gc_once()
            except OSError as exc:
                log.warning("conntrack GC failed", extra={"reason": str(exc)})
                continue
            if ct or nat:
                log.info("conntrack GC", extra={"conntrack": ct, "nat": nat})

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.service.stop()


def main() -> int:
    return serve_main("datapath", DatapathConfig, DatapathApp)


if __name__ == "__main__":
    sys.exit(main())
