"""flagella-cni: the CNI plugin (spec 1.1.0), a thin client of the endpoint
service. The runtime runs it once per operation, so it stays on the standard
library: gRPC over HTTP/2 from flagella.cni.rpc, the few messages it needs
from flagella.cni.wire (no grpcio, no protobuf runtime), JSON from
flagella.cni.cnijson (not even the json module's import)."""

from __future__ import annotations

import os
import sys

from flagella.cni import cnijson, rpc, spec, wire
from flagella.cni.spec import CniError, Invocation

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import BinaryIO, TextIO


def _error_from_rpc(exc: rpc.RpcError, inv: Invocation) -> CniError:
    code, details = exc.code, exc.details
    where = f"endpoint service at {inv.conf.endpoint_address}"
    if code in (rpc.UNAVAILABLE, rpc.DEADLINE_EXCEEDED):
        return CniError(
            spec.TRY_AGAIN_LATER, f"{where} unavailable, try again later", details or ""
        )
    if code == rpc.NOT_FOUND and inv.command == "CHECK":
        return CniError(
            spec.UNKNOWN_CONTAINER, f"container {inv.container_id} is unknown", details or ""
        )
    if code == rpc.INVALID_ARGUMENT:
        return CniError(spec.INVALID_NETWORK_CONFIG, details or "invalid request")
    return CniError(
        spec.ENDPOINT_FAILED, f"{inv.command} failed: {rpc.code_name(code)}", details or ""
    )


def run(inv: Invocation, stdout: TextIO) -> None:
    conf = inv.conf

    def call(method: str, request: bytes) -> bytes:
        return rpc.unary_call(
            conf.endpoint_address, wire.SERVICE + method, request, timeout=conf.timeout
        )

    try:
        if inv.command == "ADD":
            resp = call(
                "CreateEndpoint",
                wire.create_endpoint_request(
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
            )
            result = {"cniVersion": spec.SPEC_VERSION, **wire.create_endpoint_result(resp)}
            stdout.write(cnijson.dumps(spec.convert_result(result, conf.cni_version)))
        elif inv.command == "DEL":
            call("DeleteEndpoint", wire.delete_endpoint_request(inv.container_id, inv.ifname))
        elif inv.command == "CHECK":
            call(
                "CheckEndpoint",
                wire.check_endpoint_request(
                    inv.container_id, inv.ifname, inv.netns, cnijson.dumps(conf.prev_result)
                ),
            )
        elif inv.command == "GC":
            call(
                "GarbageCollect",
                wire.garbage_collect_request(
                    conf.node, [(a.container_id, a.ifname) for a in conf.valid_attachments]
                ),
            )
        elif inv.command == "STATUS":
            ready, dependencies = wire.endpoint_service_status(call("GetStatus", b""))
            if not ready:
                reasons = "; ".join(f"{k}: {v}" for k, v in sorted(dependencies.items()))
                raise CniError(spec.PLUGIN_NOT_AVAILABLE, "flagella is not ready", reasons)
    except rpc.RpcError as exc:
        raise _error_from_rpc(exc, inv) from None
    except (wire.WireError, UnicodeDecodeError) as exc:
        raise CniError(
            spec.ENDPOINT_FAILED, f"{inv.command} failed: bad response", str(exc)
        ) from None


def cni_main(environ: Mapping[str, str], stdin: BinaryIO, stdout: TextIO) -> int:
    raw = stdin.read()
    version = spec.requested_version(raw)
    try:
        inv = spec.parse_invocation(environ, raw)
        version = inv.conf.cni_version
        if inv.command == "VERSION":
            stdout.write(cnijson.dumps(spec.version_result(version)))
            return 0
        run(inv, stdout)
        return 0
    except CniError as err:
        stdout.write(cnijson.dumps(err.to_json(version)))
        return 1


def main() -> int:
    return cni_main(os.environ, sys.stdin.buffer, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
