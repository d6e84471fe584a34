"""flagella-cni: the CNI plugin (spec 1.1.0), a thin client of the endpoint
service. The runtime runs it once per operation, so it imports only grpc and
the endpoint stubs."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO, TextIO

import grpc

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.cni import spec
from flagella.cni.spec import CniError, Invocation


def _result_json(result: endpoint_pb2.CniResult) -> dict[str, Any]:
    interfaces = []
    for iface in result.interfaces:
        item: dict[str, Any] = {"name": iface.name, "mac": iface.mac}
        if iface.mtu:
            item["mtu"] = iface.mtu
        if iface.sandbox:
            item["sandbox"] = iface.sandbox
        interfaces.append(item)
    ips = []
    for ip in result.ips:
        entry: dict[str, Any] = {"address": ip.address, "interface": ip.interface}
        if ip.gateway:
            entry["gateway"] = ip.gateway
        ips.append(entry)
    routes = [{"dst": r.dst, **({"gw": r.gw} if r.gw else {})} for r in result.routes]
    dns: dict[str, Any] = {}
    if result.dns.nameservers:
        dns["nameservers"] = list(result.dns.nameservers)
    if result.dns.domain:
        dns["domain"] = result.dns.domain
    if result.dns.search:
        dns["search"] = list(result.dns.search)
    if result.dns.options:
        dns["options"] = list(result.dns.options)
    return {
        "cniVersion": spec.SPEC_VERSION,
        "interfaces": interfaces,
        "ips": ips,
        "routes": routes,
        "dns": dns,
    }


def _error_from_rpc(exc: grpc.RpcError, inv: Invocation) -> CniError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    where = f"endpoint service at {inv.conf.endpoint_address}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CniError(
            spec.TRY_AGAIN_LATER, f"{where} unavailable, try again later", details or ""
        )
    if code == grpc.StatusCode.NOT_FOUND and inv.command == "CHECK":
        return CniError(
            spec.UNKNOWN_CONTAINER, f"container {inv.container_id} is unknown", details or ""
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return CniError(spec.INVALID_NETWORK_CONFIG, details or "invalid request")
    return CniError(spec.ENDPOINT_FAILED, f"{inv.command} failed: {code.name}", details or "")


def run(inv: Invocation, stdout: TextIO) -> None:
    conf = inv.conf
    attachment = endpoint_pb2.Attachment(container_id=inv.container_id, ifname=inv.ifname)
    with grpc.insecure_channel(conf.endpoint_address) as channel:
        stub = endpoint_pb2_grpc.EndpointServiceStub(channel)
        try:
            if inv.command == "ADD":
                resp = stub.CreateEndpoint(
                    endpoint_pb2.CreateEndpointRequest(
                        container_id=inv.container_id,
                        netns_path=inv.netns,
                        ifname=inv.ifname,
                        pod_name=inv.pod_name,
                        pod_namespace=inv.pod_namespace,
                        labels=conf.labels,
                        resolve_labels_from_kubernetes=conf.resolve_labels_from_kubernetes,
                        node=conf.node,
                        mtu=conf.mtu,
                    ),
                    timeout=conf.timeout,
                )
                json.dump(spec.convert_result(_result_json(resp.result), conf.cni_version), stdout)
            elif inv.command == "DEL":
                stub.DeleteEndpoint(
                    endpoint_pb2.DeleteEndpointRequest(attachment=attachment), timeout=conf.timeout
                )
            elif inv.command == "CHECK":
                stub.CheckEndpoint(
                    endpoint_pb2.CheckEndpointRequest(
                        attachment=attachment,
                        netns_path=inv.netns,
                        prev_result_json=json.dumps(conf.prev_result),
                    ),
                    timeout=conf.timeout,
                )
            elif inv.command == "GC":
                stub.GarbageCollect(
                    endpoint_pb2.GarbageCollectRequest(
                        node=conf.node,
                        valid_attachments=[
                            endpoint_pb2.Attachment(container_id=a.container_id, ifname=a.ifname)
                            for a in conf.valid_attachments
                        ],
                    ),
                    timeout=conf.timeout,
                )
            elif inv.command == "STATUS":
                status = stub.GetStatus(endpoint_pb2.GetStatusRequest(), timeout=conf.timeout)
                if not status.ready:
                    reasons = "; ".join(f"{k}: {v}" for k, v in sorted(status.dependencies.items()))
                    raise CniError(spec.PLUGIN_NOT_AVAILABLE, "flagella is not ready", reasons)
        except grpc.RpcError as exc:
            raise _error_from_rpc(exc, inv) from None
        except CniError:
            raise
        except grpc.FutureTimeoutError:  # pragma: no cover - channel-level timeout
            raise CniError(spec.TRY_AGAIN_LATER, "endpoint service timed out") from None


def cni_main(environ: Mapping[str, str], stdin: BinaryIO, stdout: TextIO) -> int:
    raw = stdin.read()
    version = spec.requested_version(raw)
    try:
        inv = spec.parse_invocation(environ, raw)
        version = inv.conf.cni_version
        if inv.command == "VERSION":
            json.dump(spec.version_result(version), stdout)
            return 0
        run(inv, stdout)
        return 0
    except CniError as err:
        json.dump(err.to_json(version), stdout)
        return 1


def main() -> int:
    return cni_main(os.environ, sys.stdin.buffer, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
