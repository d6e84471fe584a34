"""Every RPC of the datapath fuzzed through real gRPC with mutual TLS: a
real datapath process in a node's netns, real BPF maps, the control plane
it follows. Each call ends with a deliberate status within its deadline, a
refusal names its field, and a refused call leaves etcd's `flagella/` keys
and every BPF map (dumped through the datapath's own ListMaps/DumpMap)
exactly as they were."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from fuzzing import NODE, UNAVAILABLE, Fuzzer, methods, run, stop_followers_first
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from harness import tls
from harness.cluster import Cluster

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.privileged, pytest.mark.beside_kernel]

#: Maps whose entries move without a call: packet counters (any packet on
#: the node's uplink, a neighbour solicitation, counts).
UNCOMPARED = {"metrics"}

#: Requests that once found a bug: each is sent first, every run.
REGRESSIONS: dict[str, list[Message]] = {
    # ListMaps lists the events ring, which DumpMap could not dump: INTERNAL.
    "/flagella.datapath.v1.DatapathService/DumpMap": [datapath_pb2.DumpMapRequest(name="events")],
    # An id too large to name a veth: ValueError in teardown, INTERNAL.
    "/flagella.datapath.v1.DatapathService/TeardownEndpoint": [
        datapath_pb2.TeardownEndpointRequest(endpoint_id=2**48)
    ],
    # A timestamp or duration outside its type's range: ValueError, INTERNAL.
    "/flagella.datapath.v1.DatapathService/ObserveFlows": [
        datapath_pb2.ObserveFlowsRequest(since=Timestamp(nanos=-1)),
        datapath_pb2.ObserveFlowsRequest(since=Timestamp(seconds=2**63 - 1)),
    ],
    "/flagella.datapath.v1.DatapathService/WaitForPolicy": [
        datapath_pb2.WaitForPolicyRequest(endpoint_id=1, timeout=Duration(seconds=-(2**63)))
    ],
}


def test_fuzz_datapath(cluster: Cluster) -> None:
    cluster.start()
    node = cluster.add_node(NODE)
    loop = asyncio.new_event_loop()
    etcd = cluster.etcd.client()
    fuzzer = Fuzzer({"datapath": node.address}, [], UNAVAILABLE)

    async def keys() -> dict[str, Any]:
        kvs, _ = await etcd.get_prefix("flagella/")
        return {kv.key: (kv.value, kv.lease) for kv in kvs}

    async def maps() -> dict[str, Any]:
        stub = datapath_pb2_grpc.DatapathServiceStub(fuzzer.channel("datapath", tls.OPERATOR))
        listed = await stub.ListMaps(datapath_pb2.ListMapsRequest(), timeout=10)
        names = [m.name for m in listed.maps if m.name not in UNCOMPARED]
        dumps = await asyncio.gather(
            *(stub.DumpMap(datapath_pb2.DumpMapRequest(name=n), timeout=10) for n in names),
            return_exceptions=True,
        )
        out = {}
        for name, dump in zip(names, dumps, strict=True):
            if isinstance(dump, grpc.aio.AioRpcError):
                # The events ring has no entries; any other refusal is a bug.
                assert dump.code() == grpc.StatusCode.FAILED_PRECONDITION, f"DumpMap {name}: {dump}"
                continue
            assert isinstance(dump, datapath_pb2.DumpMapResponse), f"DumpMap {name}: {dump!r}"
            out[name] = sorted(
                (sorted(e.key.items()), sorted(e.value.items())) for e in dump.entries
            )
        return out

    fuzzer.snapshots += [keys, maps]
    try:
        for method in (m for m in methods() if m.service == "datapath"):
            run(fuzzer, loop, method, REGRESSIONS)
    finally:
        loop.run_until_complete(fuzzer.close())
        loop.run_until_complete(etcd.close())
        loop.close()
        if node.process is not None:
            node.process.stop()
        stop_followers_first(cluster)
