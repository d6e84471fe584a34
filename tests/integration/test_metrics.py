"""Prometheus metrics of a real service process (etcd, mutual TLS): the
go-grpc-prometheus server metrics of the calls a test makes (codes
included, refused calls too), the kvstore operations behind them, process
metrics, on the process's own HTTP port (flagella.common.metrics)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.lb import wait_for
from harness.metrics import check_documented, samples, value
from harness.procs import ServiceProcess
from ipam_support import ipam_args

from flagella.api.ipam.v1 import ipam_pb2 as pb
from flagella.api.ipam.v1 import ipam_pb2_grpc as pbg
from flagella.common import pki

pytestmark = pytest.mark.integration


IPAM = "flagella.ipam.v1.IpamService"


def test_a_service_counts_its_grpc_calls_by_method_and_code_on_its_metrics_port(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    proc = spawn("ipam", *ipam_args(etcd))
    operator = pbg.IpamServiceStub(proc.channel())
    for _ in range(3):
        operator.GetStatus(pb.GetStatusRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as bad:
        operator.GetNode(pb.GetNodeRequest(name="Not A Node"), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    as_node = pbg.IpamServiceStub(proc.channel(pki.node("node-a")))
    with pytest.raises(grpc.RpcError) as denied:
        as_node.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # A stream: started, one message sent, ended by the client.
    watch = operator.WatchNodes(pb.WatchNodesRequest(), timeout=10)
    next(watch)
    watch.cancel()

    method = {"grpc_service": IPAM, "grpc_type": "unary"}

    def handled(name: str, code: str) -> float:
        return value(
            proc.scrape(), "grpc_server_handled_total", grpc_method=name, grpc_code=code, **method
        )

    assert handled("GetStatus", "OK") == 3
    assert handled("GetStatus", "PermissionDenied") == 1
    assert handled("GetNode", "InvalidArgument") == 1
    text = proc.scrape()
    assert value(text, "grpc_server_started_total", grpc_method="GetStatus", **method) == 4
    assert value(text, "grpc_server_handling_seconds_count", grpc_method="GetStatus", **method) == 4
    assert value(text, "grpc_server_msg_received_total", grpc_method="GetNode", **method) == 1
    assert value(text, "grpc_server_msg_sent_total", grpc_method="GetStatus", **method) == 3
    stream = {"grpc_service": IPAM, "grpc_type": "server_stream", "grpc_method": "WatchNodes"}
    assert value(text, "grpc_server_started_total", **stream) == 1
    assert value(text, "grpc_server_msg_sent_total", **stream) >= 1
    wait_for(lambda: value(proc.scrape(), "grpc_server_handled_total", **stream) == 1)
    # Health checks are calls like any other (the harness polls readiness).
    assert value(text, "grpc_server_handled_total", grpc_service="grpc.health.v1.Health") >= 1

    # The etcd operations behind them, and the process.
    assert value(text, "flagella_kvstore_operations_duration_seconds_count", outcome="success") > 0
    assert value(text, "process_cpu_seconds_total") > 0
    assert value(text, "process_resident_memory_bytes") > 0
    assert value(text, "python_info") == 1
    check_documented(text)
    # No label carries anything unbounded (addresses, names from requests).
    for (_name, labels), _v in samples(text).items():
        for key, val in labels:
            assert "Not A Node" not in val, (key, val)
            assert "node-a" not in val, (key, val)


def test_the_metrics_port_answers_in_the_format_asked_for_and_only_metrics(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    proc = spawn("ipam", *ipam_args(etcd))
    url = f"http://{proc.metrics_listen}/metrics"
    request = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert resp.read().decode().rstrip().endswith("# EOF")
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://{proc.metrics_listen}/", timeout=5)
    assert err.value.code == 404


def test_a_metrics_address_that_cannot_be_bound_stops_the_start_with_its_reason(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    first = spawn("ipam", *ipam_args(etcd))
    second = spawn("ipam", *ipam_args(etcd, "--metrics-listen", first.metrics_listen), wait=False)
    assert second.proc is not None
    assert second.proc.wait(timeout=30) == 1
    assert f"cannot serve metrics on {first.metrics_listen}" in second.logs()
