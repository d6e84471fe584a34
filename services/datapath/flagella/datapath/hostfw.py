"""The host firewall: this node's host policy (the policy service's
WatchHostPolicy) into the BPF maps, and the safety set that keeps the node
on its control plane whatever the host policy says.

The host endpoint's entries live in the policy map under L.HOST_EP_ID; the
config's CFG_HOST_POLICY flag turns the checks on (without a host policy
the node's own packets cost one flag test), CFG_HOST_INGRESS/EGRESS say
which directions the policy enforces. The entries are written before the
flags are raised, and the flags lowered before the entries are cleared, so
a packet never meets an enforcing host with half a policy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import grpc

from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common.addresses import host_ports
from flagella.common.backoff import Backoff
from flagella.datapath import namedports
from flagella.datapath.bpf import PolicyBudgetExceeded
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.tables import SafeEntry
from flagella.datapath.config import DatapathConfig
from flagella.datapath.handlers import identity_policy
from flagella.datapath.state import HostPolicyState

if TYPE_CHECKING:
    from flagella.datapath.service import DatapathService

log = logging.getLogger(__name__)

Resolve = Callable[[str], Iterable[str]]


def resolve_host(host: str) -> list[str]:
    """The addresses of a host name (or the address itself)."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return sorted({str(info[4][0]) for info in infos})


def _split(address: str) -> tuple[str, int] | None:
    if address.startswith("unix:"):
        return None
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def safety_entries(cfg: DatapathConfig, resolve: Resolve = resolve_host) -> set[SafeEntry]:
    """The node's traffic with its control plane: etcd's endpoints and the
    flagella services this datapath is configured with (their addresses
    and ports, both ways), this datapath's own gRPC port (the endpoint
    service calls it) and the node health port (here and on any node).
    Empty with --host-policy-safety=off."""
    if cfg.host_policy_safety != "on":
        return set()
    out: set[SafeEntry] = set()
    remotes = [
        *cfg.etcd_endpoints,
        cfg.ipam_address,
        cfg.policy_address,
        cfg.lb_address,
        cfg.endpoint_address,
    ]
    # Every replica of each (a list, or a name resolving to each).
    for address, (host, port) in ((a, hp) for a in remotes for hp in host_ports(a)):
        try:
            addrs = resolve(host)
        except OSError as exc:
            # Left out: stricter, never more open. Logged loudly.
            log.error(
                "control-plane address not resolved: not in the host policy's safety set",
                extra={"address": address, "error": str(exc)},
            )
            continue
        out.update(SafeEntry(L.SAFE_REMOTE, port, L.PROTO_TCP, a) for a in addrs)
    for own in (cfg.listen, cfg.advertise_address):
        split = _split(own) if own else None
        if split is not None:
            out.add(SafeEntry(L.SAFE_LOCAL_PORT, split[1]))
    if cfg.health_port:
        out.add(SafeEntry(L.SAFE_LOCAL_PORT, cfg.health_port))
        out.add(SafeEntry(L.SAFE_ANY_PORT, cfg.health_port))
    return out


class HostFirewall:
    def __init__(self, svc: DatapathService) -> None:
        self.svc = svc
        self.safe: set[SafeEntry] = set()

    async def write_safety_set(self) -> None:
        cfg = self.svc.config
        self.safe = await asyncio.to_thread(safety_entries, cfg)
        await self.svc.writer.run(self.svc.bpf.host_safe.replace, self.safe)
        self.svc.host_policy = dataclasses.replace(
            self.svc.host_policy, safety_entries=len(self.safe)
        )
        log.info(
            "host policy safety set",
            extra={"switch": cfg.host_policy_safety, "entries": len(self.safe)},
        )

    async def apply(self, event: policy_pb2.HostPolicyEvent) -> None:
        """The node's host policy, whole (unset: none)."""
        dp = self.svc.bpf
        labels = tuple(sorted(event.node_labels.items()))
        rules = tuple(event.rules)
        if not event.HasField("policy"):
            await self.svc.writer.run(self._set_flags, False, False, False)
            await self.svc.writer.run(dp.policy.apply_host, ())
            self.svc.host_policy = HostPolicyState(
                revision=event.revision, node_labels=labels, safety_entries=len(self.safe)
            )
            log.info("no host policy on this node", extra={"revision": event.revision})
            return
        pol = identity_policy(event.policy)
        entries = pol.entries
        if pol.named:
            # The host has no named ports of its own; egress names resolve
            # against the peers' endpoints as for pods (at this revision).
            entries = namedports.resolve(entries, (), self.svc.peer_ports)
        ingress, egress, error = pol.ingress_enforced, pol.egress_enforced, event.policy.error
        try:
            count = await self.svc.writer.run(dp.policy.apply_host, entries)
        except PolicyBudgetExceeded as exc:
            # Never a partial policy: enforce both directions with nothing
            # allowed but the safety set (fail closed).
            error = str(exc)
            ingress = egress = True
            count = await self.svc.writer.run(dp.policy.apply_host, ())
        await self.svc.writer.run(self._set_flags, True, ingress, egress)
        self.svc.host_policy = HostPolicyState(
            True, event.revision, ingress, egress, count, rules, labels, error, len(self.safe)
        )
        log.info(
            "host policy applied",
            extra={
                "revision": event.revision,
                "rules": list(rules),
                "ingress": ingress,
                "egress": egress,
                "entries": count,
                "error": error,
            },
        )

    def _set_flags(self, on: bool, ingress: bool, egress: bool) -> None:
        """Runs on the map thread (the config's one entry is rewritten whole)."""
        config = self.svc.bpf.config
        current = config.read()
        config.write(
            dataclasses.replace(current, host_policy=on, host_ingress=ingress, host_egress=egress)
        )

    async def follow(
        self,
        stub: policy_pb2_grpc.PolicyServiceAsyncStub,
        node: str,
        labels: Callable[[], Awaitable[Mapping[str, str]]],
    ) -> None:
        """Apply the node's host policy as the policy service sends it,
        forever, asking with the node's labels as labels() gives them (its
        registration's). While the stream is down the last policy stays
        enforced."""
        await self.write_safety_set()
        backoff = Backoff(0.2, 5.0)
        synced = self.svc.streams_synced
        synced.setdefault("host-policy", False)
        while True:
            try:
                request = policy_pb2.WatchHostPolicyRequest(
                    node=node, node_labels=dict(await labels())
                )
                call: Any = stub.WatchHostPolicy(request)
                async for event in call:
                    await self.apply(event)
                    synced["host-policy"] = True
                    backoff.reset()
            except grpc.aio.AioRpcError as exc:
                synced["host-policy"] = False
                log.warning("host policy stream broke", extra={"reason": exc.details()})
            await backoff.wait()
