"""Prometheus metrics of a real service process (etcd, mutual TLS): the
go-grpc-prometheus server metrics of the calls a test makes (codes
included, refused calls too), the kvstore operations behind them, process
metrics, on the process's own HTTP port (flagella.common.metrics)."""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.lb import service, wait_for
from harness.metrics import check_documented, samples, value
from harness.procs import ServiceProcess
from ipam_support import ipam_args

from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.endpoint.v1 import endpoint_pb2_grpc as endpoint_grpc
from flagella.api.ipam.v1 import ipam_pb2 as pb
from flagella.api.ipam.v1 import ipam_pb2_grpc as pbg
from flagella.api.lb.v1 import lb_pb2
from flagella.api.lb.v1 import lb_pb2_grpc as lb_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common import pki
from flagella.ipam.pool import capacity_of

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
    # The interpreter's collections, timed (a service that started has
    # collected its youngest generation many times).
    assert value(text, "flagella_python_gc_pause_seconds_count", generation="0") > 0
    assert value(text, "flagella_python_gc_pause_seconds_sum", generation="0") > 0
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


# A rule naming a CIDR (a CIDR identity), as JSON (a YAML document too).
POLICY = json.dumps(
    {
        "apiVersion": "flagella.io/v1",
        "kind": "FlagellaNetworkPolicy",
        "metadata": {"name": "web-out", "namespace": "shop"},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "web"}},
            "egress": [{"toCIDR": ["192.0.2.0/24"]}],
        },
    }
)


def phases(proc: ServiceProcess) -> dict[str, float]:
    """phase -> how many times it ended in success."""
    out: dict[str, float] = {}
    for (name, labels), v in samples(proc.scrape()).items():
        ls = dict(labels)
        if name == "flagella_bootstrap_seconds_count" and ls["outcome"] == "success":
            out[ls["phase"]] = v
    return out


def test_the_control_plane_services_export_their_figures_as_they_change(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    ipam = spawn("ipam", *ipam_args(etcd, "--cluster-cidr", "10.201.0.0/16"))
    policy = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    endpoint = spawn(
        "endpoint", "--etcd-endpoints", etcd.endpoint,
        "--ipam-address", ipam.address, "--policy-address", policy.address,
    )  # fmt: skip
    node, as_endpoint = pki.node("n1"), pki.service("endpoint")

    # ipam: capacity and used addresses of the node, per family; operations.
    assert value(ipam.scrape(), "flagella_ipam_capacity") == 0
    registered = pbg.IpamServiceStub(ipam.channel(node)).RegisterNode(
        pb.RegisterNodeRequest(name="n1"), timeout=10
    )
    (cidr,) = registered.node.pod_cidrs
    v4 = {"family": "IPv4", "node": "n1"}
    wait_for(
        lambda: (
            value(ipam.scrape(), "flagella_ipam_capacity", **v4)
            == capacity_of(ipaddress.ip_network(cidr))
        )
    )
    assert value(ipam.scrape(), "flagella_ipam_addresses", **v4) == 0
    ipam_stub = pbg.IpamServiceStub(ipam.channel(as_endpoint))
    owner = pb.Owner(container_id="c1", ifname="eth0")
    ipam_stub.Allocate(pb.AllocateRequest(node="n1", owner=owner), timeout=10)
    with pytest.raises(grpc.RpcError):
        ipam_stub.Allocate(pb.AllocateRequest(node="n2", owner=owner), timeout=10)
    wait_for(lambda: value(ipam.scrape(), "flagella_ipam_addresses", **v4) == 1)
    ops = "flagella_ipam_operations_total"
    text = ipam.scrape()
    assert value(text, ops, operation="allocate", outcome="success") == 1
    assert value(text, ops, operation="allocate") == 2  # and one failure, by its code
    ipam_stub.Release(pb.ReleaseRequest(node="n1", owner=owner), timeout=10)
    wait_for(lambda: value(ipam.scrape(), "flagella_ipam_addresses", **v4) == 0)
    assert value(ipam.scrape(), ops, operation="release", outcome="success") == 1

    # policy: identities by type, rules by source, revision, changes.
    text = policy.scrape()
    assert value(text, "flagella_identity", type="reserved") > 0
    assert value(text, "flagella_identity", type="global") == 0
    assert value(text, "flagella_policy") == 0
    revision = value(text, "flagella_policy_max_revision")
    policy_pb2_grpc.PolicyServiceStub(policy.channel(as_endpoint)).AllocateIdentity(
        policy_pb2.AllocateIdentityRequest(
            labels=[policy_pb2.Label(source="k8s", key="app", value="web")], node="n1"
        ),
        timeout=10,
    )
    operator = policy_pb2_grpc.PolicyServiceStub(policy.channel())
    operator.PutRules(policy_pb2.PutRulesRequest(document=POLICY), timeout=10)
    with pytest.raises(grpc.RpcError) as bad:
        operator.PutRules(policy_pb2.PutRulesRequest(document="kind: [nope"), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    text = policy.scrape()
    assert value(text, "flagella_identity", type="global") == 1
    assert value(text, "flagella_identity", type="cidr") == 1
    assert value(text, "flagella_policy", source="api") == 1
    assert value(text, "flagella_policy_max_revision") > revision
    assert value(text, "flagella_policy_change_total", outcome="success") == 1
    assert value(text, "flagella_policy_change_total", outcome="invalid_argument") == 1

    # lb: services by type, backends by state.
    db = service("shop/db", "10.96.5.5", 5432, [("10.201.0.10", 5432), ("10.201.0.11", 5432)])
    db.backends[1].state = lb_pb2.BACKEND_STATE_TERMINATING
    lb_grpc.LoadBalancerServiceStub(lb.channel()).UpsertService(
        lb_pb2.UpsertServiceRequest(service=db), timeout=10
    )
    wait_for(lambda: value(lb.scrape(), "flagella_services", type="ClusterIP") == 1)
    text = lb.scrape()
    assert value(text, "flagella_services", type="NodePort") == 0
    assert value(text, "flagella_service_backends", state="active") == 1
    assert value(text, "flagella_service_backends", state="terminating") == 1

    # endpoint: each CNI operation timed by command and outcome; endpoints
    # by state (none yet: an ADD that succeeds needs a node's datapath).
    cni = endpoint_grpc.EndpointServiceStub(endpoint.channel(node))
    conf = json.dumps({"cniVersion": "1.1.0", "name": "flagella", "type": "flagella-cni"})
    for command, netns in (("VERSION", ""), ("ADD", "/var/run/netns/gone")):
        cni.Cni(
            endpoint_pb2.CniRequest(
                command=command, container_id="c9", netns=netns, ifname="eth0",
                config=conf.encode(), netns_exists=False, node="n1",
            ),
            timeout=10,
        )  # fmt: skip
    text = endpoint.scrape()
    seconds = "flagella_cni_operation_duration_seconds_count"
    assert value(text, seconds, command="VERSION", outcome="success") == 1
    assert value(text, seconds, command="ADD") == 1
    assert value(text, seconds, command="ADD", outcome="success") == 0
    assert value(text, "flagella_endpoint_state", state="ready") == 0

    # Every service: its start-up phases, once each, and its names documented.
    common = {"config", "tls", "listen", "etcd_connect", "start", "first_sync", "serving"}
    for proc in (ipam, policy, lb, endpoint):
        want = dict.fromkeys(common | ({"restore"} if proc is endpoint else set()), 1)
        wait_for(lambda p=proc, w=want: phases(p) == w)
        check_documented(proc.scrape())
