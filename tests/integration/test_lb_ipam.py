"""LB-IPAM through two real lb replicas on a real etcd: pools (validation,
overlap), addresses for LoadBalancer services (distinct, requested,
conflicting, shared by sharing key, exhausted, released, reassigned), and
no address handed out twice under concurrent assignment on both replicas."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.lb import LbClient, etcd_dump, lb_with_etcd, rpc_error, service
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.insecure]

SATISFIED = "io.cilium/lb-ipam-request-satisfied"


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EtcdServer, LbClient, LbClient]]:
    tmp: Path = tmp_path_factory.mktemp("lb-ipam")
    with lb_with_etcd(tmp) as (etcd, first):
        proc = ServiceProcess("lb", ["--etcd-endpoints", etcd.endpoint], log_dir=tmp, insecure=True)
        proc.start().wait_serving()
        second = LbClient(proc.address)
        try:
            yield etcd, first, second
        finally:
            second.close()
            proc.stop()


def lb_service(name: str, fe: str, port: int = 80, **lb: object) -> pb.Service:
    svc = service(name, fe, port, [("fd00:1::1" if ":" in fe else "10.1.0.1", 8080)])
    svc.load_balancer.CopyFrom(pb.LoadBalancer(**lb))  # type: ignore[arg-type]
    return svc


def pool(name: str, *cidrs: str, **kw: object) -> pb.UpsertLbIpPoolRequest:
    blocks = [
        pb.LbIpBlock(start=c.split("-")[0], stop=c.split("-")[1])
        if "-" in c
        else pb.LbIpBlock(cidr=c)
        for c in cidrs
    ]
    return pb.UpsertLbIpPoolRequest(pool=pb.LbIpPool(name=name, blocks=blocks, **kw))  # type: ignore[arg-type]


def invalid(c: LbClient, fn: str, request: object, field: str) -> None:
    err = rpc_error(getattr(c.stub, fn), request, timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert (err.details() or "").startswith(field + ":"), err.details()


def test_pools_and_assignment(replicas: tuple[EtcdServer, LbClient, LbClient]) -> None:
    etcd, a, b = replicas
    # --- pools: validation names the field, an overlap is refused, nothing stored ---
    before = etcd_dump(etcd)
    invalid(a, "UpsertLbIpPool", pool("bad", "198.51.100.1/30"), "pool.blocks[0].cidr")
    invalid(a, "UpsertLbIpPool", pool("bad", "198.51.100.9-198.51.100.1"), "pool.blocks[0]")
    invalid(a, "UpsertLbIpPool", pool("bad name!", "198.51.100.0/30"), "pool.name")
    invalid(
        a,
        "UpsertLbIpPool",
        pool("bad", "198.51.100.0/30", service_selector={"not a key": "x"}),
        "pool.service_selector[not a key]",
    )
    assert etcd_dump(etcd) == before
    assert a.stub.UpsertLbIpPool(pool("small", "198.51.100.0/30"), timeout=10).created
    invalid(b, "UpsertLbIpPool", pool("over", "198.51.100.2-198.51.100.9"), "pool.blocks[0]")
    # A selected pool for namespace "v6" only, IPv6 as a range.
    assert b.stub.UpsertLbIpPool(
        pool(
            "six",
            "2001:db8:5::10-2001:db8:5::1f",
            service_selector={"io.kubernetes.service.namespace": "v6"},
        ),
        timeout=10,
    ).created

    # --- distinct addresses, visible in the service's answers ---
    s1 = a.upsert(lb_service("ipam/one", "10.96.9.1")).service.load_balancer
    s2 = b.upsert(lb_service("ipam/two", "10.96.9.2")).service.load_balancer
    assert s1.condition.type == SATISFIED
    assert s1.condition.satisfied
    assert len(s1.ingress) == 1
    assert len(s2.ingress) == 1
    assert s1.ingress != s2.ingress
    assert a.get("ipam/one").load_balancer.ingress == s1.ingress
    assert b.get("ipam/one").load_balancer.ingress == s1.ingress
    # The same again keeps the address.
    assert a.upsert(lb_service("ipam/one", "10.96.9.1")).service.load_balancer.ingress == s1.ingress

    # --- a requested address is honoured; a conflicting request is refused ---
    s3 = a.upsert(lb_service("ipam/three", "10.96.9.3", requested_ips=["198.51.100.3"]))
    assert list(s3.service.load_balancer.ingress) == ["198.51.100.3"]
    clash = b.upsert(lb_service("ipam/clash", "10.96.9.4", requested_ips=["198.51.100.3"]))
    cond = clash.service.load_balancer.condition
    assert not clash.service.load_balancer.ingress
    assert (cond.satisfied, cond.reason) == (False, "already_allocated")
    assert "ipam/three" in cond.message
    outside = a.upsert(lb_service("ipam/outside", "10.96.9.5", requested_ips=["192.0.2.77"]))
    assert outside.service.load_balancer.condition.reason == "out_of_pools"
    invalid(
        a,
        "UpsertService",
        pb.UpsertServiceRequest(service=lb_service("ipam/x", "10.96.9.6", requested_ips=["nope"])),
        "service.load_balancer.requested_ips[0]",
    )
    invalid(
        a,
        "UpsertService",
        pb.UpsertServiceRequest(service=lb_service("ipam/x", "10.96.9.6", families=[5])),
        "service.load_balancer.families[0]",
    )
    with pytest.raises(grpc.RpcError):
        a.get("ipam/x")  # refused: nothing stored

    # --- sharing key: one address, different ports; same port refused ---
    web = a.upsert(lb_service("ipam/web", "10.96.9.7", 80, sharing_key="k")).service
    tls = b.upsert(lb_service("ipam/tls", "10.96.9.8", 443, sharing_key="k")).service
    assert web.load_balancer.ingress == tls.load_balancer.ingress
    same_port = a.upsert(
        lb_service(
            "ipam/web2",
            "10.96.9.9",
            80,
            sharing_key="k",
            requested_ips=list(web.load_balancer.ingress),
        )
    ).service.load_balancer
    assert same_port.condition.reason == "already_allocated"
    # 198.51.100.0/30: one, two, three and the shared one; the pool is full.
    full = b.upsert(lb_service("ipam/late", "10.96.9.10")).service.load_balancer
    assert (full.condition.satisfied, full.condition.reason) == (False, "pool_exhausted")
    assert not full.ingress
    # Others are unaffected; the pool shows its use.
    assert a.get("ipam/two").load_balancer.ingress == s2.ingress
    pools = {p.name: p for p in a.stub.ListLbIpPools(pb.ListLbIpPoolsRequest(), timeout=10).pools}
    assert (pools["small"].size, pools["small"].used) == (4, 4)
    assert (pools["six"].size, pools["six"].used) == (16, 0)
    # IPv6 from the pool selecting its namespace; no IPv4 pool is left for it.
    v6 = a.upsert(lb_service("v6/api", "fd00::10", families=[6])).service.load_balancer
    assert ipaddress.ip_address(v6.ingress[0]) in ipaddress.ip_network("2001:db8:5::/64")
    none = a.upsert(lb_service("other/api", "fd00::11", families=[6])).service.load_balancer
    assert none.condition.reason == "no_pool"

    # --- release: on delete (the pending service gets the address), on type change ---
    assert b.delete("ipam/one")
    assert list(a.get("ipam/late").load_balancer.ingress) == list(s1.ingress)
    plain = a.upsert(service("ipam/two", "10.96.9.2", 80, [("10.1.0.1", 8080)])).service
    assert not plain.HasField("load_balancer")
    assert a.get("ipam/clash").load_balancer.condition.reason == "already_allocated"
    assert list(b.get("ipam/late").load_balancer.ingress) == list(s1.ingress)
    # ipam/two's address went back to the pool: the next one gets it.
    again = b.upsert(lb_service("ipam/again", "10.96.9.11")).service.load_balancer
    assert list(again.ingress) == list(s2.ingress)
    listed = {s.name: s for s in a.list("ipam").services}
    assert listed["ipam/again"].load_balancer.ingress == again.ingress
    assert not listed["ipam/two"].HasField("load_balancer")
    # The records the datapaths follow carry the addresses they serve.
    records = [json.loads(v) for v in etcd_dump(etcd, "flagella/lb/v1/services/").values()]
    external = {r["name"]: r.get("external", []) for r in records}
    assert external["ipam/again"] == list(again.ingress)
    assert external["ipam/two"] == []

    # --- a new pool satisfies what waits; concurrent claims on two replicas never share ---
    assert a.stub.UpsertLbIpPool(pool("wide", "203.0.113.0/28"), timeout=10).created
    clash_now = b.get("ipam/clash").load_balancer
    assert clash_now.condition.reason == "already_allocated"  # asked for a taken one

    def claim(i: int) -> str:
        c = (a, b)[i % 2]
        got = c.upsert(lb_service(f"race/s{i}", f"10.96.10.{i + 1}")).service.load_balancer
        assert got.condition.satisfied, got.condition
        return got.ingress[0]

    with ThreadPoolExecutor(8) as pool_:
        got = list(pool_.map(claim, range(12)))
    assert len(set(got)) == 12
    assert all(ipaddress.ip_address(x) in ipaddress.ip_network("203.0.113.0/28") for x in got)
    # etcd agrees: each address held by exactly the service that got it.
    stored = {
        k.rsplit("/", 1)[1]: v for k, v in etcd_dump(etcd, "flagella/lb/v1/lbipam/addrs/").items()
    }
    for i, addr in enumerate(got):
        assert f'"race/s{i}"' in stored[addr].decode()
    # A pool in use can be deleted: its services wait for another pool.
    assert a.stub.DeleteLbIpPool(pb.DeleteLbIpPoolRequest(name="wide"), timeout=30).deleted
    assert b.get("race/s0").load_balancer.condition.reason in ("pool_exhausted", "no_pool")


def test_an_external_ip_another_service_has_as_its_loadbalancer_address(
    replicas: tuple[EtcdServer, LbClient, LbClient],
) -> None:
    """Refused on the same protocol and port, naming that service (and
    nothing stored); on another port it is another frontend."""
    etcd, c, _ = replicas
    # Its own namespace's: the earlier test's pending services take no address of it.
    ext_only = {"io.kubernetes.service.namespace": "ext"}
    c.stub.UpsertLbIpPool(pool("ext-pool", "192.0.2.200/31", service_selector=ext_only), timeout=10)
    got = c.upsert(lb_service("ext/lb", "10.96.90.1", 80)).service
    (addr,) = got.load_balancer.ingress
    before = etcd_dump(etcd)
    svc = service("ext/ip", "10.96.90.2", 80, external_ips=["192.0.2.1", addr])
    invalid(c, "UpsertService", pb.UpsertServiceRequest(service=svc), "service.external_ips[1]")
    err = rpc_error(c.upsert, svc)
    assert "'ext/lb'" in err.details(), err.details()
    invalid(
        c,
        "UpsertServices",
        pb.UpsertServicesRequest(services=[service("ext/ok", "10.96.90.3", 80), svc]),
        "services[1].external_ips[1]",
    )
    assert etcd_dump(etcd) == before
    other_port = service("ext/ip", "10.96.90.2", 81, external_ips=[addr])
    assert list(c.upsert(other_port).service.external_ips) == [addr]
    for name in ("ext/ip", "ext/lb"):
        assert c.delete(name)
    c.stub.DeleteLbIpPool(pb.DeleteLbIpPoolRequest(name="ext-pool"), timeout=10)
