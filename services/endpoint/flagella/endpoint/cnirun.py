"""One flagella-cni invocation, run here: the node's datapath relays what the
runtime gave the plugin (environment, network configuration), and this turns
it into the endpoint service's operations and their outcome into what the
plugin prints and its exit status, as the CNI spec says (flagella.endpoint.cni).
The node is the caller's: a node creates, checks, deletes and collects only
its own endpoints."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.cni import (
    ENDPOINT_FAILED,
    INVALID_NETWORK_CONFIG,
    PLUGIN_NOT_AVAILABLE,
    SPEC_VERSION,
    TRY_AGAIN_LATER,
    UNKNOWN_CONTAINER,
    CniError,
    version_result,
)
from flagella.common.portnames import protocol_name
from flagella.common.server import status_of
from flagella.endpoint import cni
from flagella.endpoint.service import EndpointService
from flagella.endpoint.servicer import attachment_of, create_request_of, result_to_proto

log = logging.getLogger(__name__)

Status = Callable[[], Awaitable[tuple[bool, dict[str, str]]]]


def result_json(msg: endpoint_pb2.CniResult) -> dict[str, Any]:
    """A CniResult as the spec's result JSON (1.x shape), what proto3 leaves
    unset left out, as the plugin always printed it."""
    interfaces = []
    for iface in msg.interfaces:
        item: dict[str, Any] = {"name": iface.name, "mac": iface.mac}
        if iface.mtu:
            item["mtu"] = iface.mtu
        if iface.sandbox:
            item["sandbox"] = iface.sandbox
        interfaces.append(item)
    ips = []
    for ip in msg.ips:
        entry: dict[str, Any] = {"address": ip.address, "interface": ip.interface}
        if ip.gateway:
            entry["gateway"] = ip.gateway
        ips.append(entry)
    routes = [{"dst": r.dst, **({"gw": r.gw} if r.gw else {})} for r in msg.routes]
    dns: dict[str, Any] = {}
    for key in ("nameservers", "domain", "search", "options"):
        value = getattr(msg.dns, key)
        if value:
            dns[key] = value if key == "domain" else list(value)
    return {
        "cniVersion": SPEC_VERSION,
        "interfaces": interfaces,
        "ips": ips,
        "routes": routes,
        "dns": dns,
    }


def error_of(exc: Exception, inv: cni.Invocation) -> CniError:
    """A failed operation as the CNI error the runtime acts on: try again
    later when flagella (or a peer) is unavailable, nothing left behind."""
    code, details = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("CNI operation failed", exc_info=exc, extra={"command": inv.command})
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CniError(TRY_AGAIN_LATER, "flagella is unavailable, try again later", details)
    if code == grpc.StatusCode.ABORTED:
        # A concurrent change (another replica's restore or DEL): rolled
        # back, and a retry is what resolves it.
        return CniError(TRY_AGAIN_LATER, "a concurrent change, try again later", details)
    if code == grpc.StatusCode.NOT_FOUND and inv.command == "CHECK":
        return CniError(UNKNOWN_CONTAINER, f"container {inv.container_id} is unknown", details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return CniError(INVALID_NETWORK_CONFIG, details or "invalid request")
    return CniError(ENDPOINT_FAILED, f"{inv.command} failed: {code.name}", details)


#: Takes each operation's (command, CNI error code or None, seconds).
Latency = Callable[[str, int | None, float], None]


class CniRunner:
    def __init__(
        self, service: EndpointService, status: Status, latency: Latency | None = None
    ) -> None:
        self.service = service
        self.status = status
        self.latency = latency

    async def __call__(
        self, environ: Mapping[str, str], config: bytes, *, netns_exists: bool, node: str
    ) -> tuple[str, int]:
        """(what the plugin prints, its exit status) for one invocation on
        `node`. Timed, by command and outcome, when there is a latency."""
        started = time.perf_counter()
        version = cni.requested_version(config)
        try:
            inv = cni.parse_invocation(environ, config, netns_exists=netns_exists)
            version = inv.conf.cni_version
            try:
                out = await self._run(inv, node)
            except CniError:
                raise
            except Exception as exc:
                raise error_of(exc, inv) from None
        except CniError as err:
            self._timed(environ, err.code, started)
            return json.dumps(err.to_json(version)), 1
        self._timed(environ, None, started)
        return ("" if out is None else json.dumps(out)), 0

    def _timed(self, environ: Mapping[str, str], code: int | None, started: float) -> None:
        if self.latency is not None:
            command = environ.get("CNI_COMMAND", "")
            self.latency(command, code, time.perf_counter() - started)

    async def _run(self, inv: cni.Invocation, node: str) -> dict[str, Any] | None:
        conf = inv.conf
        if inv.command == "VERSION":
            return version_result(conf.cni_version)
        if inv.command == "ADD":
            request = endpoint_pb2.CreateEndpointRequest(
                container_id=inv.container_id,
                netns_path=inv.netns,
                ifname=inv.ifname,
                pod_name=inv.pod_name,
                pod_namespace=inv.pod_namespace,
                labels=conf.labels,
                resolve_labels_from_kubernetes=conf.resolve_labels_from_kubernetes,
                node=node,
                mtu=conf.mtu,
                named_ports=[
                    endpoint_pb2.NamedPort(
                        name=p.name, port=p.port, protocol=protocol_name(p.protocol)
                    )
                    for p in conf.named_ports
                ],
            )
            ep = await self.service.create(create_request_of(request))
            return cni.convert_result(result_json(result_to_proto(ep.result)), conf.cni_version)
        if inv.command == "DEL":
            await self.service.delete(*self._attachment(inv.container_id, inv.ifname), caller=node)
        elif inv.command == "CHECK":
            cid, ifname = self._attachment(inv.container_id, inv.ifname)
            await self.service.check(cid, ifname, inv.netns, caller=node)
        elif inv.command == "GC":
            valid = [
                self._attachment(a.container_id, a.ifname, f"valid_attachments[{i}]")
                for i, a in enumerate(conf.valid_attachments)
            ]
            await self.service.garbage_collect(node, valid)
        elif inv.command == "STATUS":
            ready, dependencies = await self.status()
            if not ready:
                reasons = "; ".join(f"{k}: {v}" for k, v in sorted(dependencies.items()))
                raise CniError(PLUGIN_NOT_AVAILABLE, "flagella is not ready", reasons)
        return None

    @staticmethod
    def _attachment(container_id: str, ifname: str, field: str = "attachment") -> tuple[str, str]:
        return attachment_of(
            endpoint_pb2.Attachment(container_id=container_id, ifname=ifname), field
        )
