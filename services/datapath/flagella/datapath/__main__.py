"""python -m flagella.datapath: run the datapath service of this node."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common.errors import FlagellaError
from flagella.common.server import FatalError, Runtime
from flagella.common.server import main as serve_main
from flagella.common.sync import Batch, StreamCodec, StreamSource, Table
from flagella.common.sync.reconcile import AfterBatch, Target, reconcile_table
from flagella.common.sync.stream import OpenStream
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.datapath.bgp import model as bgp_model
from flagella.datapath.bgp.metrics import BgpCollector
from flagella.datapath.bgp.speaker import Speaker
from flagella.datapath.bgp.supervisor import Gobgpd, GobgpdError
from flagella.datapath.cnirelay import CniRelay, UnsafeSocket
from flagella.datapath.config import DatapathConfig
from flagella.datapath.dnsproxy.expiry import Expiry
from flagella.datapath.dnsproxy.server import DnsProxy
from flagella.datapath.dnsproxy.teach import Teacher
from flagella.datapath.handlers import (
    Identities,
    IdentityPolicies,
    IPCacheEntryCodec,
    PolicyCodec,
    PolicySynced,
    RemoveBackends,
    ServicesCodec,
)
from flagella.datapath.healthcheck import HealthCheckServers
from flagella.datapath.hostfw import HostFirewall
from flagella.datapath.ipcache import node_entries, policy_entries
from flagella.datapath.lrp import LocalRedirects
from flagella.datapath.lrpcodec import LrpCodec
from flagella.datapath.metrics import DatapathCollector
from flagella.datapath.namedports import IPCacheValue
from flagella.datapath.node import NodeRegistration
from flagella.datapath.routes import NodeRoutes, NodeRoutesCodec
from flagella.datapath.runtime import ConfigCodec, follow
from flagella.datapath.service import DatapathService
from flagella.datapath.servicer import DatapathServicer
from flagella.datapath.tunnel import TUNNEL_DEVICE

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
M = TypeVar("M")


class DatapathApp:
    service_names = (datapath_pb2.DESCRIPTOR.services_by_name["DatapathService"].full_name,)

    def __init__(self, runtime: Runtime[DatapathConfig]) -> None:
        self.runtime = runtime
        self.service = DatapathService(runtime.config, runtime.metrics.registry)
        runtime.metrics.registry.register(DatapathCollector(self.service))
        self.registration: NodeRegistration | None = None
        self.relay: CniRelay | None = None
        self.hostfw: HostFirewall | None = None
        self.policy: policy_pb2_grpc.PolicyServiceAsyncStub | None = None
        self.dnsproxy: DnsProxy | None = None
        self.speaker: Speaker | None = None

    def register(self, server: grpc.aio.Server) -> None:
        datapath_pb2_grpc.add_DatapathServiceServicer_to_server(
            DatapathServicer(self.service, self.runtime.debuginfo(), bgp=lambda: self.speaker),
            server,
        )

    async def start(self) -> None:
        cfg = self.runtime.config
        tasks = self.runtime.tasks
        if cfg.dns_proxy_port:
            # Listening before the BPF is told its port (config in start).
            await self._open_dns_proxy()
        try:
            await self.service.start(tasks, self.runtime.phase)
        except FlagellaError as exc:
            raise FatalError(exc.details) from exc
        except OSError as exc:
            raise FatalError(f"cannot load the BPF datapath: {exc}") from exc
        tasks.supervise("bpf-gc", lambda: self._gc(cfg.gc_interval_seconds))
        tracer = self.runtime.tracing.tracer("flagella.datapath")
        if cfg.ipam_address:
            ipam = ipam_pb2_grpc.IpamServiceStub(self.runtime.channel(cfg.ipam_address, "ipam"))
            request = ipam_pb2.RegisterNodeRequest(
                name=cfg.node_name,
                addresses=[
                    ipam_pb2.NodeAddress(type=ipam_pb2.NodeAddress.TYPE_INTERNAL_IP, ip=ip)
                    for ip in cfg.node_ip
                ],
                datapath_address=cfg.advertise_address or cfg.listen,
                labels=cfg.labels,
            )
            self.registration = NodeRegistration(
                ipam, request, tracer, on_registered=self._registered
            )
            tasks.supervise("node-registration", self.registration.run)
            nodes, _ = self._stream(
                "nodes",
                lambda since: ipam.WatchNodes(
                    ipam_pb2.WatchNodesRequest(since_revision=since, batch_events=True)
                ),
                NodeRoutesCodec(),
            )
            device = TUNNEL_DEVICE if cfg.tunnel else ""
            self._reconcile(nodes, NodeRoutes(cfg.node_name, self.service.routes, device=device))
            self._reconcile(nodes, node_entries(self.service.ipcache_view), what="node-ipcache")
        if cfg.policy_address:
            policy = self.policy = policy_pb2_grpc.PolicyServiceStub(
                self.runtime.channel(cfg.policy_address, "policy")
            )
            ipcache, ipcache_source = self._stream(
                "ipcache",
                lambda since: policy.WatchIPCache(
                    policy_pb2.WatchIPCacheRequest(since_revision=since, batch_events=True)
                ),
                IPCacheEntryCodec(),
                acknowledges_resume=False,  # policy's streams answer with the changes alone
            )

            async def ipcache_applied(batch: Batch[str, IPCacheValue], revision: int) -> None:
                # The stream's last SYNCED (read before awaiting): what a
                # DNS answer waits for (DatapathService.wait_applied).
                await self.service.stream_applied("ipcache", ipcache_source.revision)

            self._reconcile(
                ipcache, Identities(policy_entries(self.service.ipcache_view)), ipcache_applied
            )
            self._reconcile(ipcache, self.service.peer_ports, what="ipcache-named-ports")
            policies, source = self._stream(
                "policy",
                lambda since: policy.WatchPolicy(
                    policy_pb2.WatchPolicyRequest(node=cfg.node_name, since_revision=since)
                ),
                PolicyCodec(),
                acknowledges_resume=False,
            )
            self._reconcile(
                policies,
                IdentityPolicies(self.service),
                PolicySynced(self.service.policy_synced, source),
            )
            runtime_config, _ = self._stream(
                "config",
                lambda since: policy.WatchConfig(
                    policy_pb2.WatchConfigRequest(node=cfg.node_name, since_revision=since)
                ),
                ConfigCodec(),
            )
            synced = self.service.streams_synced
            tasks.supervise(
                "runtime-config",
                lambda: follow(
                    runtime_config,
                    cfg.node_name,
                    self.service.apply_runtime,
                    lambda: synced.__setitem__("config", True),
                ),
            )
            hostfw = self.hostfw = HostFirewall(self.service)
            tasks.supervise(
                "host-policy", lambda: hostfw.follow(policy, cfg.node_name, self._node_labels)
            )
        if cfg.lb_address:
            lb = lb_pb2_grpc.LoadBalancerServiceStub(self.runtime.channel(cfg.lb_address, "lb"))
            services, _ = self._stream(
                "services",
                lambda since: lb.WatchServices(
                    lb_pb2.WatchServicesRequest(
                        since_revision=since, include_maglev_tables=True, batch_events=True
                    )
                ),
                ServicesCodec(cfg.node_ip, cfg.node_name),
                keep_prev=True,  # RemoveBackends: the backends a change took out
            )
            redirects = LocalRedirects(self.service.services)
            self._reconcile(services, redirects.services_target, RemoveBackends(self.service))
            health_checks = HealthCheckServers(cfg.node_ip)
            tasks.supervise("health-check-node-ports", lambda: health_checks.follow(services))
            lrps, _ = self._stream(
                "lrps",
                lambda since: lb.WatchLrps(lb_pb2.WatchLrpsRequest(since_revision=since)),
                LrpCodec(),
            )
            self._reconcile(lrps, redirects.lrps_target)
            tasks.supervise(
                "local-redirects",
                lambda: redirects.run(
                    self._local_endpoints,
                    self._identity_labels,
                    lambda ids: self.service.writer.run(self.service.bpf.remove_backends, ids),
                    self.service.endpoints_changed,
                ),
            )
            self._bgp(lb)
        if self.registration is not None:
            # Not ready before the node is registered: its pod CIDRs come from ipam.
            await self.registration.registered.wait()
        if cfg.endpoint_address:
            # Last: the plugin finds the socket once this node can take pods.
            relay = CniRelay(
                cfg.cni_socket,
                cfg.node_name,
                cfg.endpoint_address,
                self.runtime.channel(cfg.endpoint_address, "endpoint"),
            )
            try:
                await relay.open()
            except (OSError, UnsafeSocket) as exc:
                raise FatalError(f"cannot serve the CNI socket {cfg.cni_socket}: {exc}") from exc
            self.relay = relay

    async def _registered(self, node: Any) -> None:
        """The node registry's view of this node (an ipam.v1.Node)."""
        await self.service.set_node(node)
        if self.speaker is not None:
            await self.speaker.set_node(node.pod_cidrs, node.labels)

    def _bgp(self, lb: Any) -> None:
        """The BGP speaker (flagella.datapath.bgp), following the lb's peering
        policies and services; gobgpd runs only while a policy selects the
        node."""
        cfg = self.runtime.config
        policies, _ = self._stream(
            "bgp-policies",
            lambda since: lb.WatchBgpPeeringPolicies(
                lb_pb2.WatchBgpPeeringPoliciesRequest(since_revision=since)
            ),
            bgp_model.PolicyCodec(),
        )

        def open_services(table: Table[int, Any]) -> StreamSource[int, Any]:
            return StreamSource(
                "bgp-services",
                lambda since: lb.WatchServices(lb_pb2.WatchServicesRequest(since_revision=since)),
                table,
                bgp_model.ServiceCodec(),
            )

        ips = [ipaddress.ip_address(ip) for ip in cfg.node_ip]
        node = bgp_model.NodeInfo(
            name=cfg.node_name,
            labels=tuple(sorted(cfg.labels.items())),
            ipv4=next((str(ip) for ip in ips if ip.version == 4), ""),
            ipv6=next((str(ip) for ip in ips if ip.version == 6), ""),
            pod_cidrs=(),
        )
        try:
            gobgpd = Gobgpd(Path(cfg.state_dir), binary=cfg.bgp_gobgpd, user=cfg.bgp_user)
        except GobgpdError as exc:
            raise FatalError(str(exc)) from exc
        speaker = self.speaker = Speaker(
            gobgpd,
            node,
            policies,
            open_services,
            listen_port=cfg.bgp_listen_port,
            wait_for_node=self.registration is not None,
            tasks=self.runtime.tasks,
        )
        self.runtime.metrics.registry.register(BgpCollector(speaker))
        synced = self.service.streams_synced
        self.runtime.tasks.supervise(
            "follow-bgp-policies",
            lambda: speaker.follow(policies, lambda: synced.__setitem__("bgp-policies", True)),
        )

        def services_synced(now: bool) -> None:
            # Listed only while followed (a policy selects the node).
            if now:
                synced["bgp-services"] = True
            else:
                synced.pop("bgp-services", None)

        speaker.on_services_synced = services_synced
        self.runtime.tasks.supervise("bgp-speaker", speaker.run)

    def _local_endpoints(self) -> list[tuple[tuple[str, ...], int]]:
        """(addresses, identity) of this node's endpoints."""
        return [
            (tuple(a.split("/")[0] for a in rec.addresses), rec.identity)
            for rec in self.service.endpoints.values()
        ]

    async def _identity_labels(self, identity: int) -> dict[str, str]:
        """An identity's labels, each by its key and by source:key (what a
        local redirect policy's selector matches); none without a policy
        service (no pod is then selected)."""
        if self.policy is None or identity <= 0:
            return {}
        got = await self.policy.GetIdentity(policy_pb2.GetIdentityRequest(id=identity), timeout=10)
        labels: dict[str, str] = {}
        for label in got.labels:
            labels[label.key] = label.value
            labels[f"{label.source}:{label.key}"] = label.value
        return labels

    async def _open_dns_proxy(self) -> None:
        cfg = self.runtime.config
        teach = None
        if cfg.policy_address:
            policy = policy_pb2_grpc.PolicyServiceStub(
                self.runtime.channel(cfg.policy_address, "policy")
            )
            teach = Teacher(
                policy, cfg.node_name, self.service.wait_applied, cfg.dns_proxy_response_max_delay
            )
            expiry = Expiry(policy, cfg.node_name, self.service.live_peers, self._forget_taught)
            self.runtime.tasks.supervise(
                "fqdn-expiry", lambda: expiry.run(cfg.tofqdns_gc_interval_seconds)
            )
        proxy = DnsProxy(
            cfg.dns_proxy_port,
            self.service.dns_asker,
            teach,
            self.service.has_identity,
            self.service.flows.publish,
            upstream_timeout=cfg.dns_proxy_upstream_timeout,
            min_ttl=cfg.tofqdns_min_ttl,
        )
        try:
            await proxy.open()
        except OSError as exc:
            await proxy.close()
            raise FatalError(
                f"cannot open the DNS proxy on port {cfg.dns_proxy_port}: {exc}"
            ) from exc
        self.dnsproxy = proxy

    def _forget_taught(self, endpoint: int, name: str) -> None:
        if self.dnsproxy is not None:
            self.dnsproxy.taught.forget(endpoint, name)

    async def _node_labels(self) -> dict[str, str]:
        """This node's labels as its registration in the node registry has
        them (what host policies select it by); without ipam, --node-labels."""
        reg = self.registration
        if reg is None:
            return self.runtime.config.labels
        await reg.registered.wait()
        node = reg.node
        return dict(node.labels) if node is not None else self.runtime.config.labels

    def _stream(
        self,
        name: str,
        open_stream: OpenStream,
        codec: StreamCodec[M, K, R],
        *,
        acknowledges_resume: bool = True,
        keep_prev: bool = False,
    ) -> tuple[Table[K, R], StreamSource[K, R]]:
        """A control-plane stream mirrored into a table of its own."""
        # (Read only by this process's reconcilers and followers.)
        table: Table[K, R] = Table(name, keep_prev=keep_prev, log_size=LOCAL_LOG_SIZE)
        source = StreamSource(
            name, open_stream, table, codec, acknowledges_resume=acknowledges_resume
        )
        self.service.streams_synced.setdefault(name, False)
        self.runtime.tasks.supervise(f"stream-{name}", source.run)
        return table, source

    def _reconcile(
        self,
        table: Table[K, R],
        target: Target[K, R],
        after: AfterBatch[K, R] | None = None,
        *,
        what: str = "",
    ) -> None:
        """The table into desired state; the stream counts as synced once
        its first snapshot is there."""
        streams_synced = self.service.streams_synced

        async def applied(batch: Batch[K, R], revision: int) -> None:
            if after is not None:
                await after(batch, revision)
            streams_synced[table.name] = True

        self.runtime.tasks.supervise(
            f"reconcile-{what or table.name}", lambda: reconcile_table(table, target, after=applied)
        )

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
        # The runtime stopped the tasks (streams, reconcilers, GC) already.
        if self.relay is not None:
            await self.relay.close()
        if self.dnsproxy is not None:
            await self.dnsproxy.close()
        if self.speaker is not None:
            await self.speaker.close()
        await self.service.stop()


def main() -> int:
    return serve_main("datapath", DatapathConfig, DatapathApp)


if __name__ == "__main__":
    sys.exit(main())
