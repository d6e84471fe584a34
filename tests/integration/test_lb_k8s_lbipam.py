"""LB-IPAM from Kubernetes: LoadBalancer Services get addresses written to
status.loadBalancer.ingress (with Cilium's io.cilium/lb-ipam-request-satisfied
condition), CiliumLoadBalancerIPPool objects become pools the API cannot
change, an overlapping one is marked conflicting and not used. Against the
stand-in API server (harness/kube_api.py) and a real lb process and etcd."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.kube_api import KubeListWatchServer, k8s_endpoint_slice, k8s_service
from harness.lb import LbClient, rpc_error, wait_for
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

CONDITION = "io.cilium/lb-ipam-request-satisfied"
POOLS = "ciliumloadbalancerippools"


def pool_object(name: str, blocks: list[dict[str, str]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2alpha1",
        "kind": "CiliumLoadBalancerIPPool",
        "metadata": {"name": name},
        "spec": {"blocks": blocks, **spec},
    }


def lb_service(
    name: str, cluster_ip: str, ports: list[tuple[str, int, int]], **spec: Any
) -> dict[str, Any]:
    obj = k8s_service(
        "shop",
        name,
        cluster_ip,
        [
            {"name": n, "port": p, "protocol": "TCP", "targetPort": 8080, "nodePort": np}
            for n, p, np in ports
        ],
        type="LoadBalancer",
    )
    annotations = spec.pop("annotations", {})
    obj["metadata"]["annotations"] = annotations
    obj["spec"].update(spec)
    return obj


def status(kube: KubeListWatchServer, name: str) -> tuple[list[str], dict[str, Any] | None]:
    """A Service's status.loadBalancer.ingress addresses and LB-IPAM condition."""
    obj = kube.get("services", "shop", name) or {}
    st = obj.get("status") or {}
    ingress = [i["ip"] for i in (st.get("loadBalancer") or {}).get("ingress") or []]
    cond = next((c for c in st.get("conditions") or [] if c["type"] == CONDITION), None)
    return ingress, cond


def exists(c: LbClient, name: str) -> bool:
    try:
        c.get(name)
    except grpc.RpcError:
        return False
    return True


def pool_conflict(kube: KubeListWatchServer, name: str) -> dict[str, Any] | None:
    obj = kube.get(POOLS, "", name) or {}
    conds = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "cilium.io/PoolConflict"), None)


def test_loadbalancer_services_and_pools_from_kubernetes(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    kube = KubeListWatchServer().start()
    try:
        _scenario(etcd, spawn, kube, tmp_path)
    finally:
        kube.stop()


def _scenario(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    kube: KubeListWatchServer,
    tmp_path: Path,
) -> None:
    kube.apply(
        POOLS,
        pool_object(
            "blue",
            [{"cidr": "198.51.100.0/29"}],
            serviceSelector={
                "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["internal"]}]
            },
        ),
    )
    web = lb_service(
        "web",
        "10.96.60.1",
        [("http", 80, 30080), ("https", 443, 30443)],
        externalTrafficPolicy="Local",
        externalIPs=["203.0.113.60", "2001:db8::60"],
    )
    kube.apply("services", web)
    kube.apply(
        "endpointslices",
        k8s_endpoint_slice(
            "shop",
            "web-1",
            "web",
            [{"name": "http", "port": 8080, "protocol": "TCP"}],
            [{"addresses": ["10.20.0.1"], "nodeName": "n1", "conditions": {"ready": True}}],
        ),
    )
    # The first status write fails (API server trouble): retried.
    kube.refuse("PATCH", "services/status")
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig))
    c = LbClient(lb.address)

    # The pool comes from its object; the API can neither change nor delete it.
    def pools() -> dict[str, pb.LbIpPool]:
        return {
            p.name: p for p in c.stub.ListLbIpPools(pb.ListLbIpPoolsRequest(), timeout=10).pools
        }

    wait_for(lambda: "blue" in pools())
    blue = pools()["blue"]
    assert (blue.source, blue.size, blue.conflicting) == ("kubernetes", 8, False)
    err = rpc_error(
        c.stub.UpsertLbIpPool,
        pb.UpsertLbIpPoolRequest(
            pool=pb.LbIpPool(name="blue", blocks=[pb.LbIpBlock(cidr="192.0.2.0/30")])
        ),
        timeout=10,
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("pool.name: ")
    err = rpc_error(c.stub.DeleteLbIpPool, pb.DeleteLbIpPoolRequest(name="blue"), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("name: ")

    # Both ports of the LoadBalancer Service share one address, written back
    # with the condition; eTP and the external IPs of its family reach lb.
    wait_for(lambda: status(kube, "web")[0] == ["198.51.100.0"])
    # The refused write, then the one that landed.
    patches = [
        r
        for r in kube.requests
        if r.startswith("PATCH /api/v1/namespaces/shop/services/web/status")
    ]
    assert len(patches) >= 2, patches
    _, cond = status(kube, "web")
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("True", "satisfied")
    for port in ("http", "https"):
        svc = c.get(f"shop/web:{port}")
        assert list(svc.load_balancer.ingress) == ["198.51.100.0"], svc
        assert svc.external_traffic_policy == pb.TRAFFIC_POLICY_LOCAL
        assert list(svc.external_ips) == ["203.0.113.60"]
    assert [b.node for b in c.get("shop/web:http").backends] == ["n1"]

    # A requested address is honoured (spec.loadBalancerIP); the same one
    # asked for by another Service (the lbipam annotation) is refused with
    # its condition and no address.
    kube.apply(
        "services",
        lb_service("req", "10.96.60.2", [("http", 80, 30081)], loadBalancerIP="198.51.100.5"),
    )
    wait_for(lambda: status(kube, "req")[0] == ["198.51.100.5"])
    kube.apply(
        "services",
        lb_service(
            "clash",
            "10.96.60.3",
            [("http", 80, 30082)],
            annotations={"lbipam.cilium.io/ips": "198.51.100.5"},
        ),
    )
    wait_for(lambda: (status(kube, "clash")[1] or {}).get("reason") == "already_allocated")
    ingress, cond = status(kube, "clash")
    assert ingress == []
    assert cond is not None
    assert cond["status"] == "False"
    assert "198.51.100.5" in cond["message"]
    assert "shop/req:http" in cond["message"]
    # A sharing key lets it share on another port.
    clash = lb_service(
        "clash",
        "10.96.60.3",
        [("http", 8080, 30082)],
        annotations={"lbipam.cilium.io/ips": "198.51.100.5", "lbipam.cilium.io/sharing-key": "k"},
    )
    req = lb_service(
        "req",
        "10.96.60.2",
        [("http", 80, 30081)],
        loadBalancerIP="198.51.100.5",
        annotations={"lbipam.cilium.io/sharing-key": "k"},
    )
    kube.apply("services", req)
    kube.apply("services", clash)
    wait_for(lambda: status(kube, "clash")[0] == ["198.51.100.5"])
    assert status(kube, "req")[0] == ["198.51.100.5"]

    # blue's selector (tier NotIn internal) leaves an internal Service out.
    internal = lb_service("int", "10.96.60.6", [("http", 80, 30085)])
    internal["metadata"]["labels"] = {"tier": "internal"}
    kube.apply("services", internal)
    wait_for(lambda: (status(kube, "int")[1] or {}).get("reason") == "no_pool")

    # An overlapping pool object is stored, marked conflicting, not used.
    kube.apply(POOLS, pool_object("green", [{"start": "198.51.100.6", "stop": "198.51.100.12"}]))
    wait_for(lambda: (pool_conflict(kube, "green") or {}).get("status") == "True")
    green = pool_conflict(kube, "green")
    assert green is not None
    assert green["reason"] == "cidr_overlap"
    assert "'blue'" in green["message"]
    assert (pool_conflict(kube, "blue") or {}).get("status") == "False"
    assert pools()["green"].conflicting
    # Its own addresses are no one's: asked for, out of pools.
    kube.apply(
        "services",
        lb_service("far", "10.96.60.4", [("http", 80, 30083)], loadBalancerIP="198.51.100.10"),
    )
    wait_for(lambda: (status(kube, "far")[1] or {}).get("reason") == "out_of_pools")
    # Without blue, green is no longer conflicting and serves the request.
    kube.delete(POOLS, "", "blue")
    wait_for(lambda: status(kube, "far")[0] == ["198.51.100.10"])
    wait_for(lambda: (pool_conflict(kube, "green") or {}).get("status") == "False")
    assert "blue" not in pools()
    # blue's addresses went with it: web moves into green; the address req
    # asked for is in no pool now.
    wait_for(lambda: status(kube, "web")[0] not in ([], ["198.51.100.0"]))
    (moved,) = status(kube, "web")[0]
    assert moved in {f"198.51.100.{i}" for i in range(6, 13)}
    wait_for(lambda: (status(kube, "req")[1] or {}).get("reason") == "out_of_pools")
    assert status(kube, "req")[0] == []

    # No longer a LoadBalancer: the status is cleared, the claim released.
    far = copy.deepcopy(kube.get("services", "shop", "far"))
    assert far is not None
    far["spec"]["type"] = "NodePort"
    kube.apply("services", far)
    wait_for(lambda: status(kube, "far") == ([], None))
    wait_for(lambda: not c.get("shop/far:http").load_balancer.ingress)
    # Handed to another implementation (its class): the claim is released,
    # our condition goes, the addresses in the status are that one's to write.
    web_now = copy.deepcopy(kube.get("services", "shop", "web"))
    assert web_now is not None
    web_now["spec"]["loadBalancerClass"] = "example.com/lb"
    kube.apply("services", web_now)
    wait_for(lambda: status(kube, "web") == ([moved], None))
    wait_for(lambda: not c.get("shop/web:http").HasField("load_balancer"))
    # Another class is not LB-IPAM's: no claim, no status.
    kube.apply(
        "services",
        lb_service(
            "other", "10.96.60.5", [("http", 80, 30084)], loadBalancerClass="example.com/lb"
        ),
    )
    wait_for(lambda: exists(c, "shop/other:http"))
    assert status(kube, "other") == ([], None)
    assert not c.get("shop/other:http").HasField("load_balancer")
    c.close()
