"""A node whose datapath is restarting (its lease lapsed, its pod CIDRs
kept) gives CNI ADD "try again later" (code 11), not a permanent error; a
node that never registered stays a permanent error (issue 18 item 7). Real
ipam, policy and endpoint processes, the real plugin through the node's
relay (the datapath's own code, without BPF), nothing left behind."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from harness.cni import cni, netconf, node_relay
from harness.etcd import EtcdServer
from harness.lb import etcd_dump
from harness.procs import ServiceProcess
from harness.tls import session
from ipam_support import wait_for

from flagella.api.ipam.v1 import ipam_pb2 as pb
from flagella.api.ipam.v1 import ipam_pb2_grpc
from flagella.cni import ENDPOINT_FAILED, TRY_AGAIN_LATER
from flagella.common import pki

pytestmark = pytest.mark.integration


def test_add_on_a_lapsed_node_is_try_again_later(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    common = ["--etcd-endpoints", etcd.endpoint]
    ipam = spawn("ipam", *common, "--cluster-cidr", "10.210.0.0/16")
    policy = spawn("policy", *common, "--lb-address", "")
    endpoint = spawn(
        "endpoint", *common, "--ipam-address", ipam.address, "--policy-address", policy.address
    )
    # The node registers (as its datapath does) with a short lease, then
    # stops renewing it, as a datapath that is down.
    as_node = ipam_pb2_grpc.IpamServiceStub(session().channel(ipam.address, pki.node("lapsed")))
    request = pb.RegisterNodeRequest(name="lapsed", datapath_address="unix:/nonexistent.sock")
    request.lease_ttl.seconds = 2
    as_node.RegisterNode(request, timeout=10)
    operator = ipam_pb2_grpc.IpamServiceStub(session().channel(ipam.address))

    def lapsed() -> bool:
        try:
            operator.GetNode(pb.GetNodeRequest(name="lapsed"), timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.NOT_FOUND
        return False

    wait_for(lapsed, timeout=15)

    outcomes = {}
    for node in ("lapsed", "never-registered"):
        with node_relay(endpoint.address, node) as sock:
            started = time.monotonic()
            rc, out = cni(
                "ADD",
                netconf(sock, {"app": "a"}),
                container_id=f"c-{node}",
                netns="/proc/self/ns/net",
            )
            outcomes[node] = (
                rc,
                out.get("code"),
                f"{out.get('msg')}: {out.get('details')}",
                time.monotonic() - started,
            )

    rc, code, details, took = outcomes["lapsed"]
    assert (rc, code) == (1, TRY_AGAIN_LATER), outcomes
    assert "registration lapsed" in details
    assert took < 5
    rc, code, details, _ = outcomes["never-registered"]
    assert (rc, code) == (1, ENDPOINT_FAILED), outcomes
    assert "NOT_FOUND" in details

    # Nothing behind: no allocation on the node, no endpoint record.
    allocations = operator.ListAllocations(pb.ListAllocationsRequest(node="lapsed"), timeout=10)
    assert not allocations.allocations
    assert etcd_dump(etcd, "flagella/endpoint/v1/endpoints/") == {}
    assert etcd_dump(etcd, "flagella/endpoint/v1/ids/") == {}
