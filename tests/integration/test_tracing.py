"""A call that crosses two services is one trace: the datapath registering
its node with ipam exports spans over OTLP from both processes, with one
trace id, correct parent links and each span carrying its service name."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from harness.etcd import EtcdServer
from harness.otlp import OtlpReceiver, RecordedSpan
from harness.procs import ServiceProcess

pytestmark = pytest.mark.integration

METHOD = "/flagella.ipam.v1.IpamService/RegisterNode"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def test_register_node_is_one_trace_across_datapath_and_ipam(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], receiver: OtlpReceiver
) -> None:
    env = receiver.env()
    ipam = spawn("ipam", "--etcd-endpoints", etcd.endpoint, env=env)
    spawn(
        "datapath",
        "--node-name",
        "trace-node",
        "--node-ip",
        "192.0.2.10",
        "--ipam-address",
        ipam.address,
        env=env,
    )

    def complete(spans: list[RecordedSpan]) -> bool:
        """The server span of a registration, its client span and the root
        span have all been exported (each process exports in its own time)."""
        by_id = {s.span_id: s for s in spans}
        for server in spans:
            if server.service != "flagella-ipam" or server.name != METHOD:
                continue
            client = by_id.get(server.parent_span_id)
            if client is not None and client.parent_span_id in by_id:
                return True
        return False

    spans = receiver.wait_for(complete)
    ids = {s.span_id for s in spans}
    server = next(
        s
        for s in spans
        if s.service == "flagella-ipam" and s.name == METHOD and s.parent_span_id in ids
    )
    trace = [s for s in spans if s.trace_id == server.trace_id]
    by_id = {s.span_id: s for s in trace}

    client = by_id[server.parent_span_id]
    assert server.kind == OtlpReceiver.SPAN_KIND_SERVER
    assert client.kind == OtlpReceiver.SPAN_KIND_CLIENT
    assert client.service == "flagella-datapath"
    assert client.name == METHOD

    root = by_id[client.parent_span_id]
    assert root.service == "flagella-datapath"
    assert root.name == "datapath.register_node"
    assert root.parent_span_id == ""
    assert root.attributes["flagella.node"] == "trace-node"
    assert {s.service for s in trace} == {"flagella-datapath", "flagella-ipam"}
    # Health checks and reflection are not traced.
    assert not [s for s in spans if "grpc.health" in s.name or "reflection" in s.name]
