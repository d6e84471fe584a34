"""Kubernetes Services and EndpointSlices become flagella services.

No API server can run on these machines: the lb process talks, with the
`kubernetes` client, to KubeListWatchServer, a local HTTP server that speaks
the Kubernetes API's list/watch protocol (harness/kube_api.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.kube_api import KubeListWatchServer, k8s_endpoint_slice, k8s_service
from harness.lb import LbClient, rpc_error, service, wait_for
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

PORTS = [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]
SLICE_PORTS = [{"name": "http", "port": 8080, "protocol": "TCP"}]


def ep(addr: str, *, ready: bool = True, terminating: bool = False) -> dict[str, object]:
    return {
        "addresses": [addr],
        "nodeName": "node-1",
        "conditions": {"ready": ready, "serving": ready or terminating, "terminating": terminating},
    }


@pytest.fixture
def kube_api() -> Iterator[KubeListWatchServer]:
    server = KubeListWatchServer().start()
    try:
        yield server
    finally:
        server.stop()


def backends_of(c: LbClient, name: str) -> dict[str, int] | None:
    try:
        svc = c.get(name)
    except grpc.RpcError:
        return None
    return {b.address: b.state for b in svc.backends}


def test_service_and_endpointslice_from_a_local_kubernetes_list_watch_api_server(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    kube_api: KubeListWatchServer,
    tmp_path: Path,
) -> None:
    kube_api.apply(
        "services",
        k8s_service(
            "shop",
            "web",
            "10.96.50.1",
            PORTS,
            annotations={"flagella.io/lb-algorithm": "maglev"},
            session_affinity_timeout=300,
        ),
    )
    kube_api.apply(
        "endpointslices",
        k8s_endpoint_slice("shop", "web-1", "web", SLICE_PORTS, [ep("10.20.0.1"), ep("10.20.0.2")]),
    )
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig))
    c = LbClient(lb.address)

    # The initial list becomes a service.
    wait_for(lambda: backends_of(c, "shop/web:http"))
    svc = c.get("shop/web:http")
    assert svc.source == "kubernetes"
    assert svc.namespace == "shop"
    assert (svc.frontend.address, svc.frontend.port, svc.frontend.protocol) == (
        "10.96.50.1",
        80,
        pb.PROTOCOL_TCP,
    )
    assert svc.type == pb.SERVICE_TYPE_CLUSTER_IP
    assert svc.algorithm == pb.ALGORITHM_MAGLEV
    assert svc.session_affinity.type == pb.SessionAffinity.TYPE_CLIENT_IP
    assert svc.session_affinity.timeout.seconds == 300
    assert {(b.address, b.port) for b in svc.backends} == {
        ("10.20.0.1", 8080),
        ("10.20.0.2", 8080),
    }
    ids = {b.address: b.id for b in svc.backends}
    assert set(c.table("shop/web:http").backend_ids) == set(ids.values())

    # Watched changes: one endpoint terminating, one added.
    kube_api.apply(
        "endpointslices",
        k8s_endpoint_slice(
            "shop",
            "web-1",
            "web",
            SLICE_PORTS,
            [ep("10.20.0.1"), ep("10.20.0.2", ready=False, terminating=True), ep("10.20.0.3")],
        ),
    )
    wait_for(
        lambda: (
            backends_of(c, "shop/web:http")
            == {
                "10.20.0.1": pb.BACKEND_STATE_ACTIVE,
                "10.20.0.2": pb.BACKEND_STATE_TERMINATING,
                "10.20.0.3": pb.BACKEND_STATE_ACTIVE,
            }
        )
    )
    svc = c.get("shop/web:http")
    assert {b.address: b.id for b in svc.backends if b.address in ids} == ids
    assert ids["10.20.0.2"] not in c.table("shop/web:http").backend_ids

    # The gRPC API cannot change what Kubernetes owns.
    err = rpc_error(c.upsert, service("shop/web:http", "10.96.50.1", 80))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("service.name: ")
    assert rpc_error(c.delete, "shop/web:http").code() == grpc.StatusCode.FAILED_PRECONDITION

    # A NodePort Service.
    kube_api.apply(
        "services",
        k8s_service(
            "shop",
            "api",
            "10.96.50.2",
            [{"port": 443, "protocol": "TCP", "targetPort": 8443, "nodePort": 30443}],
            type="NodePort",
        ),
    )
    wait_for(lambda: backends_of(c, "shop/api:443") is not None)
    api = c.get("shop/api:443")
    assert (api.type, api.node_port) == (pb.SERVICE_TYPE_NODE_PORT, 30443)
    assert api.algorithm == pb.ALGORITHM_RANDOM

    # Deleted in Kubernetes: gone here.
    kube_api.delete("services", "shop", "web")
    wait_for(lambda: backends_of(c, "shop/web:http") is None)
    assert [s.name for s in c.list("shop").services] == ["shop/api:443"]
    c.close()


def test_relist_after_410_gone_and_stale_services_removed_at_start(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    kube_api: KubeListWatchServer,
    tmp_path: Path,
) -> None:
    kube_api.apply("services", k8s_service("a", "one", "10.96.60.1", PORTS))
    kube_api.apply("services", k8s_service("a", "two", "10.96.60.2", PORTS))
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig))
    c = LbClient(lb.address)
    wait_for(lambda: len(c.list("a").services) == 2)
    c.upsert(service("a/mine", "10.96.60.9", 80))  # an API service: never touched
    one_id = c.get("a/one:http").id

    # While the lb is down: one Service goes, the other gets endpoints.
    lb.stop()
    kube_api.delete("services", "a", "two")
    kube_api.apply(
        "endpointslices",
        k8s_endpoint_slice("a", "one-x", "one", SLICE_PORTS, [ep("10.21.0.1")]),
    )
    kube_api.compact()  # and history is gone
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig))
    c.close()
    c = LbClient(lb.address)
    wait_for(lambda: backends_of(c, "a/one:http") == {"10.21.0.1": pb.BACKEND_STATE_ACTIVE})
    assert c.get("a/one:http").id == one_id
    wait_for(lambda: [s.name for s in c.list("a").services] == ["a/mine", "a/one:http"])

    # The open watches end and their resourceVersion is gone: the next watch
    # answers 410 Gone, and the lb lists again and picks up what changed.
    lists = sum("watch=" not in r for r in kube_api.requests)
    kube_api.expire_watches()
    kube_api.apply(
        "endpointslices",
        k8s_endpoint_slice("a", "one-x", "one", SLICE_PORTS, [ep("10.21.0.1"), ep("10.21.0.2")]),
    )
    wait_for(lambda: len(backends_of(c, "a/one:http") or {}) == 2)
    assert kube_api.gone_sent >= 1, "\n".join(kube_api.requests)
    assert sum("watch=" not in r for r in kube_api.requests) > lists
    c.close()


def test_initial_sync_of_many_services_in_batches_with_one_invalid(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    kube_api: KubeListWatchServer,
    tmp_path: Path,
) -> None:
    """1,200 Services at start are written in batches (more than one, as a
    batch holds at most 1,000); one whose ClusterIP another (API) service
    already has makes its batch fall back to one Service at a time, so every
    other Service is still written and only that one is left out."""
    for i in range(1200):
        kube_api.apply(
            "services", k8s_service("bulk", f"s{i}", f"10.97.{i // 250}.{i % 250 + 1}", PORTS)
        )
    kube_api.apply("services", k8s_service("bulk", "clash", "10.97.200.1", PORTS))
    api_lb = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    c0 = LbClient(api_lb.address)
    c0.upsert(service("api/holder", "10.97.200.1", 80))
    c0.close()
    api_lb.stop()

    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig))
    c = LbClient(lb.address)
    wait_for(lambda: len(c.list("bulk").services) == 1200, timeout=60)
    names = {s.name for s in c.list("bulk").services}
    assert names == {f"bulk/s{i}:http" for i in range(1200)}
    assert c.get("api/holder").source == "api"
    log = lb.logs()
    assert "kubernetes batch not written whole" in log
    assert "kubernetes service rejected" in log
    c.close()


def test_a_change_that_cannot_be_written_while_etcd_is_down_lands_when_it_is_back(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    kube_api: KubeListWatchServer,
    tmp_path: Path,
) -> None:
    kube_api.apply("services", k8s_service("r", "one", "10.96.70.1", PORTS))
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    lb = spawn(
        "lb",
        "--etcd-endpoints",
        etcd.endpoint,
        "--etcd-timeout",
        "1",
        "--kubeconfig",
        str(kubeconfig),
    )
    c = LbClient(lb.address)
    wait_for(lambda: backends_of(c, "r/one:http") == {})
    etcd.stop()
    kube_api.apply(
        "endpointslices", k8s_endpoint_slice("r", "one-x", "one", SLICE_PORTS, [ep("10.22.0.1")])
    )
    wait_for(lambda: "kubernetes service not written, will retry" in lb.logs())
    etcd.start()
    # Retried after a backoff, with no further change from Kubernetes.
    wait_for(
        lambda: backends_of(c, "r/one:http") == {"10.22.0.1": pb.BACKEND_STATE_ACTIVE}, timeout=60
    )
    c.close()


def test_two_lb_replicas_on_the_stand_in_api_server_one_writes_the_other_takes_over(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    kube_api: KubeListWatchServer,
    tmp_path: Path,
) -> None:
    """Only the holder of the Lease flagella-lb-services writes; killed
    with -9, the other replica takes over within the lease duration and
    writes what changed, losing and duplicating nothing."""
    kube_api.apply("services", k8s_service("ha", "one", "10.96.80.1", PORTS))
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    flags = [
        "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig),
        "--leader-lease-duration", "2", "--leader-renew-deadline", "1.5",
        "--leader-retry-period", "0.25",
    ]  # fmt: skip

    def holder() -> str:
        lease = kube_api.lease("flagella", "flagella-lb-services")
        return str(lease["spec"]["holderIdentity"]) if lease else ""

    a = spawn("lb", *flags)
    wait_for(holder)
    first = holder()
    b = spawn("lb", *flags)
    c = LbClient(b.address)
    wait_for(lambda: backends_of(c, "ha/one:http") == {})
    one_id = c.get("ha/one:http").id
    assert "leading" not in b.logs()
    assert holder() == first

    a.kill9()
    wait_for(lambda: holder() not in ("", first), timeout=10)
    kube_api.apply("services", k8s_service("ha", "two", "10.96.80.2", PORTS))
    kube_api.apply(
        "endpointslices", k8s_endpoint_slice("ha", "one-x", "one", SLICE_PORTS, [ep("10.22.0.1")])
    )
    wait_for(lambda: backends_of(c, "ha/one:http") == {"10.22.0.1": pb.BACKEND_STATE_ACTIVE})
    wait_for(lambda: [s.name for s in c.list("ha").services] == ["ha/one:http", "ha/two:http"])
    assert c.get("ha/one:http").id == one_id
    assert '"leading"' in b.logs()
    c.close()
