"""Every RPC of the control plane (ipam, policy, endpoint, lb) and of the
flow relay, fuzzed through real gRPC with mutual TLS against real processes
and a real etcd: each call ends with a deliberate status within its
deadline, a refusal names its field, and a refused call leaves etcd's
`flagella/` keys exactly as they were (fuzzing.py says how)."""

from __future__ import annotations

import pytest
from fuzzing import NODE, Method, Plane, methods, run
from google.protobuf.message import Message

from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.api.relay.v1 import relay_pb2

pytestmark = pytest.mark.integration

MIB_X, MIB_E = "x" * (1 << 20), "é" * (1 << 20)  # 1 MiB and 2 MiB in UTF-8
CNI_CONFIG = b'{"cniVersion": "1.1.0", "name": "flagella", "type": "flagella-cni"}'

#: Requests that once found a bug (an INTERNAL, a timeout, a partial write,
#: a refusal naming no field): each is sent first, every run.
REGRESSIONS: dict[str, list[Message]] = {
    # Refused as ".ifname": the field path of an attachment given flat.
    "/flagella.endpoint.v1.EndpointService/CreateEndpoint": [
        endpoint_pb2.CreateEndpointRequest(container_id="c1", ifname="", node=NODE)
    ],
    # A name of megabytes went to etcd as a key: etcd refused the read,
    # UNAVAILABLE ("etcd error") for what is a bad argument.
    "/flagella.lb.v1.LoadBalancerService/GetService": [lb_pb2.GetServiceRequest(name=MIB_E)],
    "/flagella.lb.v1.LoadBalancerService/DeleteService": [lb_pb2.DeleteServiceRequest(name=MIB_E)],
    "/flagella.lb.v1.LoadBalancerService/GetMaglevTable": [
        lb_pb2.GetMaglevTableRequest(name=MIB_E)
    ],
    "/flagella.policy.v1.PolicyService/DeleteRule": [policy_pb2.DeleteRuleRequest(name=MIB_E)],
    "/flagella.policy.v1.PolicyService/DeleteCIDRGroup": [
        policy_pb2.DeleteCIDRGroupRequest(name=MIB_E)
    ],
    # The refusal quoted the whole value: a status message over the client's
    # 16 KiB trailer limit, seen as RESOURCE_EXHAUSTED "Stream removed".
    "/flagella.ipam.v1.IpamService/GetNode": [ipam_pb2.GetNodeRequest(name=MIB_X)],
    "/flagella.policy.v1.PolicyService/WatchPolicy": [policy_pb2.WatchPolicyRequest(node=MIB_X)],
    # ... and the authorizer's refusal, quoting the node name it refused.
    "/flagella.ipam.v1.IpamService/RenewNode": [ipam_pb2.RenewNodeRequest(name=MIB_E)],
    # ... and a CNI error object quoting the request, a response over 4 MiB.
    "/flagella.endpoint.v1.EndpointService/Cni": [
        endpoint_pb2.CniRequest(node=NODE, config=CNI_CONFIG, **{"command": "ADD", name: MIB_E})
        for name in ("command", "container_id", "netns", "ifname", "args", "path")
    ],
    # A document nested deeper than the JSON decoder's recursion limit:
    # RecursionError (not a ValueError), INTERNAL.
    "/flagella.lb.v1.LoadBalancerService/CreateLrp": [
        lb_pb2.CreateLrpRequest(document="[" * 100_000)
    ],
    "/flagella.lb.v1.LoadBalancerService/UpsertBgpPeeringPolicy": [
        lb_pb2.UpsertBgpPeeringPolicyRequest(document="[" * 100_000)
    ],
    # An option name with a bracket: "set[[]" is no field path.
    "/flagella.policy.v1.PolicyService/PatchConfig": [
        policy_pb2.PatchConfigRequest(set={"[": "x"}),
        policy_pb2.PatchConfigRequest(set={"a]'\"": "x"}),
    ],
    # A lookup time no Timestamp may hold: INTERNAL from protobuf's check.
    "/flagella.policy.v1.PolicyService/UpsertFQDNCache": [
        policy_pb2.UpsertFQDNCacheRequest(
            node=NODE,
            entries=[
                policy_pb2.FQDNCacheEntry(
                    endpoint="1", name="a.example", ips=["192.0.2.1"], ttl=60, lookup={"seconds": s}
                )
            ],
        )
        for s in (-(2**63), 253402300799)
    ],
    # NOT_FOUND naming no field.
    "/flagella.relay.v1.RelayService/ObserveFlows": [relay_pb2.ObserveRequest(nodes=["nope"])],
}

CONTROL_PLANE = [m for m in methods() if m.service != "datapath"]


@pytest.mark.parametrize("method", CONTROL_PLANE, ids=lambda m: m.id)
def test_fuzz(plane: Plane, method: Method) -> None:
    run(plane.fuzzer, plane.loop, method, REGRESSIONS)
