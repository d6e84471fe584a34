"""The endpoint service and the Kubernetes API, against KubeListWatchServer
(harness/kube_api.py), the local HTTP server that stands in for the API
server, and a real etcd (endpoint records written there as the service
writes them): two replicas elect one writer of FlagellaEndpoints, whose
first sync removes a stale one, and which another takes over when it dies; a failed identity change is reported as
an Event on the pod; CNI ADD's label read names the missing pod, and fails
closed while the API server is away (health flagella.kubernetes says so).
Traffic and identities through real pods: tests/e2e/test_k8s_endpoints.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from harness.etcd import EtcdServer
from harness.kube_api import KubeListWatchServer
from harness.netns import wait_until
from harness.procs import ServiceProcess

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.common import pki
from flagella.endpoint.flagellaendpoint import MANAGED_BY
from flagella.endpoint.kube import LEASE_NAME, RELABEL_FAILED
from flagella.endpoint.model import Endpoint, State
from flagella.endpoint.store import EndpointStore

pytestmark = pytest.mark.integration

LEADER = ["--leader-lease-duration", "2", "--leader-renew-deadline", "1.5",
          "--leader-retry-period", "0.25"]  # fmt: skip
SERVING = health_pb2.HealthCheckResponse.SERVING
NOWHERE = "127.0.0.1:9"  # ipam and policy: not needed by what is tested here


@pytest.fixture
def kube_api(request: pytest.FixtureRequest) -> Iterator[KubeListWatchServer]:
    """The stand-in API server; `@pytest.mark.parametrize("kube_api", [("x",)],
    indirect=True)` leaves resource x unserved (a cluster without its CRD)."""
    without = tuple(getattr(request, "param", ()))
    with KubeListWatchServer(without=without) as server:
        server.apply("namespaces", {"metadata": {"name": "shop", "labels": {"team": "a"}}})
        yield server


@pytest.fixture
def start_endpoint(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], kube_api: KubeListWatchServer,
    tmp_path: Path,
) -> Callable[[], ServiceProcess]:  # fmt: skip
    kubeconfig = str(kube_api.write_kubeconfig(tmp_path / "kubeconfig"))

    def start() -> ServiceProcess:
        return spawn(
            "endpoint", "--etcd-endpoints", etcd.endpoint, "--ipam-address", NOWHERE,
            "--policy-address", NOWHERE, "--gc-interval-seconds", "0",
            "--kubeconfig", kubeconfig, *LEADER,
        )  # fmt: skip

    return start


def pod(namespace: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    meta = {"namespace": namespace, "name": name, "labels": labels}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": "n1"}}


def write(etcd: EtcdServer, ep: Endpoint) -> Endpoint:
    """Create the endpoint's record (a new id), or update it, in etcd."""

    async def run() -> Endpoint:
        client = etcd.client()
        try:
            store = EndpointStore(client)
            found = await store.get(ep.container_id, ep.ifname)
            if found is None:
                return (await store.create(ep)).endpoint
            await store.update(ep, found[1])
            return ep
        finally:
            await client.close()

    return asyncio.run(run())


def ready_endpoint(**kw: Any) -> Endpoint:
    fields: dict[str, Any] = {
        "id": 0, "container_id": "c-web", "ifname": "eth0", "netns_path": "/run/netns/x",
        "node": "n1", "pod_name": "web-0", "pod_namespace": "shop", "labels": {"app": "web"},
        "identity": 300, "addresses": ["10.0.0.5/32"], "state": State.READY,
        "policy_revision": 3,
    }  # fmt: skip
    return Endpoint(**{**fields, **kw})


def log_count(proc: ServiceProcess, message: str) -> int:
    return sum(message in line for line in proc.logs().splitlines())


def replica_identity(proc: ServiceProcess) -> str:
    for line in proc.logs().splitlines():
        if "following pods and namespaces" in line:
            return str(line.split('"identity": "')[1].split('"')[0])
    raise AssertionError("the replica does not follow the API server")


def test_two_replicas_elect_one_writer_of_flagellaendpoints_on_the_stand_in_api_server(
    etcd: EtcdServer, kube_api: KubeListWatchServer, start_endpoint: Callable[[], ServiceProcess]
) -> None:
    kube_api.apply("pods", pod("shop", "web-0", {"app": "web"}))
    uid = (kube_api.get("pods", "shop", "web-0") or {})["metadata"]["uid"]
    # Left by an earlier run, for an endpoint long gone.
    stale = {"namespace": "shop", "name": "gone", "labels": {MANAGED_BY[0]: MANAGED_BY[1]}}
    kube_api.apply("flagellaendpoints", {"metadata": stale, "status": {"id": 1}})
    replicas = [start_endpoint(), start_endpoint()]
    ep = write(etcd, ready_endpoint())

    def shows(identity: int, state: str) -> bool:
        obj = kube_api.get("flagellaendpoints", "shop", "web-0")
        return bool(obj and (obj["status"]["identity"]["id"], obj["status"]["state"]) == (
            identity, state))  # fmt: skip

    assert wait_until(lambda: shows(300, "ready"), 10)
    assert kube_api.get("flagellaendpoints", "shop", "gone") is None
    obj = kube_api.get("flagellaendpoints", "shop", "web-0")
    assert obj is not None
    assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    assert obj["status"]["networking"]["addressing"] == [{"interface": "eth0", "ipv4": "10.0.0.5"}]
    lease = kube_api.lease("flagella", LEASE_NAME)
    assert lease is not None
    holder = lease["spec"]["holderIdentity"]
    [leader] = [r for r in replicas if replica_identity(r) == holder]
    [follower] = [r for r in replicas if r is not leader]
    assert "kubernetes endpoint sync" not in follower.logs()
    # The leader dies: the other takes over within the lease and follows on.
    leader.kill9()
    write(etcd, dataclasses.replace(ep, state=State.NOT_READY, identity=301))
    assert wait_until(lambda: shows(301, "not-ready"), 10)
    assert "kubernetes endpoint sync" in follower.logs()
    after = kube_api.lease("flagella", LEASE_NAME)
    assert after is not None
    assert after["spec"]["holderIdentity"] == replica_identity(follower)
    # The endpoint goes: so does its object.
    write(etcd, dataclasses.replace(ep, state=State.READY))
    asyncio.run(_delete(etcd, ep))
    assert wait_until(lambda: kube_api.get("flagellaendpoints", "shop", "web-0") is None, 10)


async def _delete(etcd: EtcdServer, ep: Endpoint) -> None:
    client = etcd.client()
    try:
        await EndpointStore(client).delete(ep)
    finally:
        await client.close()


def test_an_identity_change_that_fails_is_an_event_on_the_pod_in_the_stand_in_api_server(
    etcd: EtcdServer, kube_api: KubeListWatchServer, start_endpoint: Callable[[], ServiceProcess]
) -> None:
    """The pod's labels changed, and the policy service cannot be reached:
    the endpoint keeps its identity, and the pod gets one Warning Event."""
    kube_api.apply("pods", pod("shop", "web-0", {"app": "web", "tier": "front"}))
    write(etcd, ready_endpoint(labels_from_kubernetes=True))
    proc = start_endpoint()
    assert wait_until(lambda: kube_api.events_about("Pod", "shop", "web-0"), 10)
    [event] = kube_api.events_about("Pod", "shop", "web-0")
    assert event["reason"] == RELABEL_FAILED
    assert event["type"] == "Warning"
    assert "keeps identity 300" in event["message"]
    assert wait_until(lambda: kube_api.get("flagellaendpoints", "shop", "web-0") is not None, 10)
    obj = kube_api.get("flagellaendpoints", "shop", "web-0")
    assert obj is not None
    assert obj["status"]["identity"]["id"] == 300
    # Retried, but reported once for this version of the pod.
    assert wait_until(lambda: log_count(proc, "endpoint identity not changed") >= 2, 10)
    assert len(kube_api.events_about("Pod", "shop", "web-0")) == 1


@pytest.mark.parametrize("kube_api", [("flagellaendpoints",)], indirect=True)
def test_labels_are_followed_without_the_flagellaendpoint_crd_on_the_stand_in_api_server(
    etcd: EtcdServer, kube_api: KubeListWatchServer, start_endpoint: Callable[[], ServiceProcess]
) -> None:
    """A cluster without the FlagellaEndpoint CRD: the endpoint service
    still follows pod labels (here it tries, and reports that the policy
    service cannot be reached), and says in its health that not every
    watcher is listed."""
    kube_api.apply("pods", pod("shop", "web-0", {"app": "web", "tier": "front"}))
    write(etcd, ready_endpoint(labels_from_kubernetes=True))
    proc = start_endpoint()
    assert wait_until(lambda: kube_api.events_about("Pod", "shop", "web-0"), 10)
    assert proc.health("flagella.kubernetes") != SERVING
    assert proc.health() == SERVING


def test_cni_add_reads_its_labels_from_the_stand_in_api_server_and_fails_closed_without_it(
    kube_api: KubeListWatchServer, start_endpoint: Callable[[], ServiceProcess]
) -> None:
    proc = start_endpoint()
    assert wait_until(lambda: proc.health("flagella.kubernetes") == SERVING, 10)
    request = endpoint_pb2.CreateEndpointRequest(
        container_id="c-new", netns_path="/run/netns/new", ifname="eth0", node="n1",
        pod_name="absent", pod_namespace="shop", resolve_labels_from_kubernetes=True,
    )  # fmt: skip
    with proc.channel(pki.node("n1")) as channel:
        stub = endpoint_pb2_grpc.EndpointServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.CreateEndpoint(request, timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "pod_name" in str(missing.value.details())
        kube_api.down()
        assert wait_until(lambda: proc.health("flagella.kubernetes") != SERVING, 10)
        with pytest.raises(grpc.RpcError) as away:
            stub.CreateEndpoint(request, timeout=10)
        assert away.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "kubernetes" in str(away.value.details())
        # The service itself stays ready: it still deletes and answers.
        assert proc.health() == SERVING
        kube_api.up()
        assert wait_until(lambda: proc.health("flagella.kubernetes") == SERVING, 20)
