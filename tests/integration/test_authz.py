"""Who may call what, through the real services: every RPC of every service
(enumerated from the proto descriptors) refuses callers without a
certificate or with one from another CA, and answers each identity as the
table written HERE says (independently of flagella.common.authz: the two
must agree)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from harness import tls
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from harness.suite import five_services

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common import authz, pki
from flagella.endpoint.model import Endpoint, State
from flagella.endpoint.store import EndpointStore

pytestmark = pytest.mark.integration

API = {
    "ipam": ipam_pb2.DESCRIPTOR.services_by_name["IpamService"],
    "policy": policy_pb2.DESCRIPTOR.services_by_name["PolicyService"],
    "endpoint": endpoint_pb2.DESCRIPTOR.services_by_name["EndpointService"],
    "lb": lb_pb2.DESCRIPTOR.services_by_name["LoadBalancerService"],
    "datapath": datapath_pb2.DESCRIPTOR.services_by_name["DatapathService"],
}
COMMON = [
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
]

IDENTITIES = {
    "ipam": pki.service("ipam"),
    "policy": pki.service("policy"),
    "endpoint": pki.service("endpoint"),
    "lb": pki.service("lb"),
    "relay": pki.service("relay"),
    "node-a": pki.node("node-a"),
    "node-b": pki.node("node-b"),
    "operator": pki.operator("alice"),
}
EVERYONE = set(IDENTITIES)
NODES = {"node-a", "node-b"}
EP = {"endpoint"}
OP = {"operator"}
RELAY = {"relay"}

# Requests that name node-a where a method is scoped to a node: node-a
# asks for itself, node-b for someone else.
FOR_NODE_A: dict[str, dict[str, Any]] = {
    "/flagella.ipam.v1.IpamService/RegisterNode": {"name": "node-a"},
    "/flagella.ipam.v1.IpamService/RenewNode": {"name": "node-a"},
    "/flagella.ipam.v1.IpamService/DeregisterNode": {"name": "node-a"},
    "/flagella.policy.v1.PolicyService/WatchPolicy": {"node": "node-a"},
    "/flagella.policy.v1.PolicyService/WatchHostPolicy": {"node": "node-a"},
    "/flagella.policy.v1.PolicyService/UpsertFQDNCache": {"node": "node-a"},
    "/flagella.policy.v1.PolicyService/DeleteFQDNCache": {"node": "node-a"},
    "/flagella.policy.v1.PolicyService/GetIdentityEndpoints": {"node": "node-a"},
    "/flagella.policy.v1.PolicyService/WatchConfig": {"node": "node-a"},
    "/flagella.endpoint.v1.EndpointService/Cni": {"node": "node-a"},
    "/flagella.endpoint.v1.EndpointService/CreateEndpoint": {"node": "node-a"},
    "/flagella.endpoint.v1.EndpointService/GarbageCollect": {"node": "node-a"},
    "/flagella.endpoint.v1.EndpointService/ListEndpoints": {"node": "node-a"},
}

#: Written from the issue and the design, not from authz.TABLE.
EXPECTED: dict[str, set[str]] = {
    "ipam/RegisterNode": {"node-a"},
    "ipam/RenewNode": {"node-a"},
    "ipam/DeregisterNode": {"node-a", "operator"},
    "ipam/GetNode": EP | NODES | OP | RELAY,
    "ipam/ListNodes": EP | NODES | OP | RELAY,
    "ipam/WatchNodes": EP | NODES | OP | RELAY,
    "ipam/Allocate": EP,
    "ipam/AllocateIP": EP,
    "ipam/CommitAllocation": EP,
    "ipam/Release": EP | OP,
    "ipam/ListAllocations": EP | OP,
    "ipam/Reconcile": EP,
    "ipam/GetStatus": OP,
    "ipam/GetNodeIds": NODES | OP,
    "ipam/GetDebuginfo": OP,
    "policy/AllocateIdentity": EP,
    "policy/ReleaseIdentity": EP,
    # Nodes read their endpoints' labels: local redirect policies' selectors.
    "policy/GetIdentity": EP | OP | NODES,
    # The relay names the ends of its web page's flows.
    "policy/ListIdentities": OP | RELAY,
    "policy/UpsertIPCache": EP,
    "policy/DeleteIPCache": EP,
    "policy/ListIPCache": NODES | OP,
    "policy/WatchIPCache": NODES | OP,
    "policy/PutRules": OP,
    "policy/GetRule": OP,
    "policy/DeleteRule": OP,
    "policy/ListRules": OP,
    "policy/PutCIDRGroup": OP,
    "policy/DeleteCIDRGroup": OP,
    "policy/ListCIDRGroups": OP,
    "policy/ResolvePolicy": OP,
    "policy/TracePolicy": OP,
    "policy/WatchPolicy": {"node-a", "operator"},
    "policy/WatchHostPolicy": {"node-a", "operator"},
    # A node's DNS proxy writes its own FQDN cache; operators flush it.
    "policy/UpsertFQDNCache": {"node-a"},
    "policy/DeleteFQDNCache": {"node-a", "operator"},
    "policy/ListFQDNCache": NODES | OP,
    "policy/ListFQDNSelectors": NODES | OP,
    "policy/GetPolicySelectors": NODES | OP,
    "policy/GetIdentityEndpoints": {"node-a", "operator"},
    "policy/GetConfig": NODES | OP,
    "policy/PatchConfig": OP,
    "policy/WatchConfig": {"node-a", "operator"},
    "policy/GetDebuginfo": OP,
    "lb/UpsertService": OP,
    "lb/UpsertServices": OP,
    "lb/GetService": NODES | OP,
    "lb/DeleteService": OP,
    "lb/ListServices": NODES | OP | {"policy"} | RELAY,
    "lb/WatchServices": NODES | OP | {"policy"},
    "lb/GetMaglevTable": NODES | OP,
    "lb/GetDebuginfo": OP,
    # Local redirect policies: written by operators, followed by every node.
    "lb/CreateLrp": OP,
    "lb/DeleteLrp": OP,
    "lb/GetLrp": NODES | OP,
    "lb/WatchLrps": NODES | OP,
    "lb/UpsertBgpPeeringPolicy": OP,
    "lb/DeleteBgpPeeringPolicy": OP,
    "lb/ListBgpPeeringPolicies": NODES | OP,
    "lb/WatchBgpPeeringPolicies": NODES,
    "lb/UpsertLbIpPool": OP,
    "lb/DeleteLbIpPool": OP,
    "lb/ListLbIpPools": NODES | OP,
    # A node's datapath relays its CNI plugin's invocations, for itself.
    "endpoint/Cni": {"node-a"},
    "endpoint/CreateEndpoint": {"node-a"},
    # No such endpoint: it is on no node, any node may look (and find nothing).
    "endpoint/GetEndpoint": NODES | OP,
    "endpoint/ListEndpoints": {"node-a", "operator", "relay"},
    "endpoint/DeleteEndpoint": NODES,
    "endpoint/PatchEndpointLabels": OP,
    "endpoint/GetEndpointLog": OP,
    "endpoint/GetEndpointHealth": OP,
    "endpoint/CheckEndpoint": NODES,
    "endpoint/GarbageCollect": {"node-a"},
    "endpoint/GetStatus": NODES | OP,
    "endpoint/GetEndpointConfig": OP,
    "endpoint/PatchEndpointConfig": OP,
    "endpoint/GetEndpointLabels": OP,
    "endpoint/GetDebuginfo": OP,
    "datapath/SetupEndpoint": EP,
    "datapath/TeardownEndpoint": EP,
    "datapath/UpdateEndpoint": EP,
    "datapath/GetEndpoint": EP | OP,
    "datapath/ListEndpoints": EP | OP,
    "datapath/WaitForPolicy": EP,
    "datapath/ListMaps": OP,
    "datapath/DumpMap": OP,
    "datapath/GetStatus": OP,
    "datapath/ObserveFlows": OP | RELAY,
    "datapath/GetPrefilter": OP,
    "datapath/PatchPrefilter": OP,
    "datapath/DeletePrefilter": OP,
    "datapath/GetMapEvents": OP,
    "datapath/GetDebuginfo": OP,
    "datapath/GetCgroupDumpMetadata": OP,
    "datapath/GetBgpPeers": OP,
    "datapath/GetBgpRoutes": OP,
    "datapath/GetBgpRoutePolicies": OP,
}


@pytest.fixture
def suite(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], tmp_path: Path
) -> Iterator[dict[str, ServiceProcess]]:
    """The five services with mutual TLS; the datapath is node-a's."""
    with five_services(spawn, etcd, tmp_path, "node-a") as procs:
        yield procs


def methods(svc: str) -> list[tuple[str, Any]]:
    """(full method name, method descriptor) of everything svc serves."""
    out = []
    for service in (API[svc], *COMMON):
        for m in service.methods:
            out.append((f"/{service.full_name}/{m.name}", m))
    return out


def request_for(name: str, method: Any) -> Message:
    return GetMessageClass(method.input_type)(**FOR_NODE_A.get(name, {}))


async def call(channel: grpc.aio.Channel, name: str, method: Any) -> grpc.StatusCode:
    """The status of one call (OK for a stream that started answering)."""
    out_cls = GetMessageClass(method.output_type)
    request = request_for(name, method)
    kw = {
        "request_serializer": type(request).SerializeToString,
        "response_deserializer": out_cls.FromString,
    }
    try:
        if method.client_streaming:
            stream = channel.stream_stream(name, **kw)(iter([request]), timeout=3)
            await stream.read()
        elif method.server_streaming:
            stream = channel.unary_stream(name, **kw)(request, timeout=3)
            await stream.read()
        else:
            await channel.unary_unary(name, **kw)(request, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_every_method_answers_each_identity_as_the_table_says(
    suite: dict[str, ServiceProcess],
) -> None:
    session = tls.session()
    got: dict[str, set[str]] = {}
    for svc, proc in suite.items():
        for who, identity in IDENTITIES.items():
            async with session.aio_channel(proc.address, identity) as ch:
                for name, method in methods(svc):
                    code = await call(ch, name, method)
                    assert code not in (
                        grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.UNAVAILABLE,
                    ), (who, name, code)
                    key = (
                        f"{svc}/{method.name}"
                        if method.containing_service in API.values()
                        else name
                    )
                    if code != grpc.StatusCode.PERMISSION_DENIED:
                        got.setdefault(key, set()).add(who)
                    else:
                        got.setdefault(key, set())
    expected = {**EXPECTED}
    for svc in suite:
        for name, method in methods(svc):
            if method.containing_service not in API.values():
                expected[name] = EVERYONE
    assert got == expected


def test_every_method_has_an_expectation_and_an_authz_entry() -> None:
    """A new RPC cannot be forgotten: it needs a line in both tables."""
    for svc in API:
        for name, method in methods(svc):
            assert name in authz.TABLE, name
            if method.containing_service in API.values():
                assert f"{svc}/{method.name}" in EXPECTED, name


async def test_no_certificate_or_a_foreign_one_never_reaches_a_handler(
    suite: dict[str, ServiceProcess], tmp_path: Path
) -> None:
    foreign = tls.TestPki(tmp_path / "foreign")
    stranger = foreign.bundle(pki.operator("alice"))
    session = tls.session()
    callers = {
        "plaintext": grpc.aio.insecure_channel,
        "TLS without a client certificate": lambda address: grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(session.ca.cert_pem)
        ),
        "a certificate from another CA": lambda address: grpc.aio.secure_channel(
            address,
            grpc.ssl_channel_credentials(
                session.ca.cert_pem,
                (stranger / "tls.key").read_bytes(),
                (stranger / "tls.crt").read_bytes(),
            ),
        ),
    }
    for svc, proc in suite.items():
        for what, make in callers.items():
            async with make(proc.address) as ch:
                for name, method in methods(svc):
                    code = await call(ch, name, method)
                    assert code == grpc.StatusCode.UNAVAILABLE, (svc, what, name, code)
        # Nothing got as far as authorization, let alone a handler.
        assert "permission denied" not in "".join(
            line for line in proc.logs().splitlines() if "alice" in line
        )


def denied(exc: grpc.RpcError) -> str:
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc
    return str(exc.details())


def test_a_node_acts_only_for_itself(suite: dict[str, ServiceProcess], etcd: EtcdServer) -> None:
    node_a = pki.node("node-a")
    with suite["ipam"].channel(node_a) as ch:
        stub = ipam_pb2_grpc.IpamServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterNode(ipam_pb2.RegisterNodeRequest(name="node-b"), timeout=10)
        msg = denied(err.value)
        assert "spiffe://flagella/node/node-a" in msg
        assert "/flagella.ipam.v1.IpamService/RegisterNode" in msg
        with pytest.raises(grpc.RpcError) as err:
            stub.DeregisterNode(ipam_pb2.DeregisterNodeRequest(name="node-b"), timeout=10)
        denied(err.value)
        # Itself: allowed.
        node = stub.RegisterNode(
            ipam_pb2.RegisterNodeRequest(name="node-a", datapath_address="127.0.0.1:1"), timeout=10
        ).node
        assert node.name == "node-a"

    # An endpoint that lives on node-b.
    async def plant() -> int:
        client = etcd.client()
        try:
            created = await EndpointStore(client).create(
                Endpoint(
                    id=0,
                    container_id="ctr-on-b",
                    ifname="eth0",
                    netns_path="/var/run/netns/b",
                    node="node-b",
                    state=State.READY,
                )
            )
        finally:
            await client.close()
        return created.endpoint.id

    ep_id = asyncio.run(plant())
    on_b = endpoint_pb2.Attachment(container_id="ctr-on-b", ifname="eth0")
    with suite["endpoint"].channel(node_a) as ch:
        stub_e = endpoint_pb2_grpc.EndpointServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub_e.CreateEndpoint(
                endpoint_pb2.CreateEndpointRequest(
                    container_id="c1", netns_path="/var/run/netns/x", ifname="eth0", node="node-b"
                ),
                timeout=10,
            )
        assert "node 'node-b' is not the caller's node" in denied(err.value)
        for attempt in (
            lambda: stub_e.DeleteEndpoint(endpoint_pb2.DeleteEndpointRequest(attachment=on_b)),
            lambda: stub_e.DeleteEndpoint(endpoint_pb2.DeleteEndpointRequest(id=ep_id)),
            lambda: stub_e.CheckEndpoint(endpoint_pb2.CheckEndpointRequest(attachment=on_b)),
            lambda: stub_e.GetEndpoint(endpoint_pb2.GetEndpointRequest(id=ep_id)),
            lambda: stub_e.GarbageCollect(endpoint_pb2.GarbageCollectRequest(node="node-b")),
        ):
            with pytest.raises(grpc.RpcError) as err:
                attempt()
            denied(err.value)
    # node-b sees its own endpoint.
    with suite["endpoint"].channel(pki.node("node-b")) as ch:
        got = endpoint_pb2_grpc.EndpointServiceStub(ch).GetEndpoint(
            endpoint_pb2.GetEndpointRequest(attachment=on_b), timeout=10
        )
        assert got.node == "node-b"

    # The endpoint service cannot write policy rules.
    with suite["policy"].channel(pki.service("endpoint")) as ch:
        with pytest.raises(grpc.RpcError) as err:
            policy_pb2_grpc.PolicyServiceStub(ch).PutRules(
                policy_pb2.PutRulesRequest(document="[]"), timeout=10
            )
        msg = denied(err.value)
        assert "spiffe://flagella/service/endpoint may not call" in msg
    assert "permission denied" in suite["policy"].logs()


def test_the_table_prints_as_markdown() -> None:
    text = authz.markdown()
    assert "| `flagella.ipam.v1.IpamService/RegisterNode` | a node, itself only" in text
    assert text.count("\n") == len(authz.TABLE) + 2
