"""UpsertServices (many services per call) against a real etcd and a real lb
process: what it stores equals what one UpsertService per service stores,
ids are stable, a batch is checked as a whole before anything is stored,
and a chunk that loses a race is committed one by one."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.lb import LbClient, etcd_dump, lb_with_etcd, rpc_error, service
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]


@pytest.fixture(scope="module")
def lb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, LbClient]]:
    """One etcd and one lb process for the module (tests use distinct names)."""
    with lb_with_etcd(
        tmp_path_factory.mktemp("lb-batch"), "--node-port-range", "30000-30099"
    ) as suite:
        yield suite


def batch(c: LbClient, services: list[pb.Service]) -> pb.UpsertServicesResponse:
    return c.stub.UpsertServices(pb.UpsertServicesRequest(services=services), timeout=30)


def many(prefix: str, n: int, third: int = 10) -> list[pb.Service]:
    return [
        service(
            f"{prefix}/s{i}",
            f"10.{third}.{i // 250}.{i % 250 + 1}",
            80,
            [(f"10.{third + 100}.{i // 250}.{i % 250 + 1}", 8080)],
        )
        for i in range(n)
    ]


def test_batch_creates_updates_and_keeps_ids(lb: tuple[EtcdServer, LbClient]) -> None:
    etcd, c = lb
    # 300 services need several transactions (etcd allows 128 operations).
    services = many("batch", 300)
    first = batch(c, services)
    assert len(first.results) == 300
    assert all(r.created for r in first.results)
    got = [r.service for r in first.results]
    assert [s.name for s in got] == [s.name for s in services]
    assert len({s.id for s in got}) == 300
    assert len({s.rev_nat_id for s in got}) == 300
    assert len({b.id for s in got for b in s.backends}) == 300
    # Stored exactly as returned, and read back the same by name.
    for s in got[::37]:
        assert c.get(s.name) == s
    stored = etcd_dump(etcd)
    for s in got:
        key = f"flagella/lb/v1/services/{s.id:05d}"
        assert json.loads(stored[key])["name"] == s.name
        assert stored[f"flagella/lb/v1/names/{s.name}"] == str(s.id).encode()

    # The same batch again: nothing changes, not even a revision.
    again = batch(c, services)
    assert [r.created for r in again.results] == [False] * 300
    assert [r.service for r in again.results] == got
    assert etcd_dump(etcd) == stored

    # Mixed: 10 changed (a second backend), 10 new; ids of the others kept.
    mixed = services[:10] + many("batch2", 10, third=11)
    for s in mixed[:10]:
        s.backends.add(address="10.120.9.9", port=8080)
    third = batch(c, mixed)
    assert [r.created for r in third.results] == [False] * 10 + [True] * 10
    for before, after in zip(got[:10], third.results[:10], strict=True):
        assert after.service.id == before.id
        assert after.service.rev_nat_id == before.rev_nat_id
        assert len(after.service.backends) == 2
        assert after.service.backends[0].id == before.backends[0].id
    assert c.get(services[10].name) == got[10]


@pytest.mark.parametrize(
    ("what", "index", "change", "field"),
    [
        ("bad port", 2, {"port": 0}, "services[2].frontend.port"),
        ("bad backend", 1, {"backends": [("10.0.0.x", 80)]}, "services[1].backends[0].address"),
        ("no name", 0, {"name": ""}, "services[0].name"),
        ("frontend of another", 2, {"address": "10.96.7.1"}, "services[2].frontend"),
        ("duplicate name", 2, {"name": "dup/s0"}, "services[2].name"),
        ("duplicate frontend", 1, {"address": "10.12.0.1"}, "services[1].frontend"),
    ],
)
def test_a_bad_service_rejects_the_batch_and_stores_nothing(
    lb: tuple[EtcdServer, LbClient], what: str, index: int, change: dict[str, object], field: str
) -> None:
    etcd, c = lb
    c.upsert(service("dup/owner", "10.96.7.1", 80, [("10.2.0.9", 80)]))
    before = etcd_dump(etcd)
    services = many("dup", 3, third=12)
    bad = services[index]
    if "name" in change:
        bad.name = str(change["name"])
    if "port" in change:
        bad.frontend.port = int(str(change["port"]))
    if "address" in change:
        bad.frontend.address = str(change["address"])
    if "backends" in change:
        del bad.backends[:]
        bad.backends.add(address="10.0.0.x", port=80)
    err = rpc_error(batch, c, services)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.details())
    assert err.details().startswith(f"{field}: "), (what, err.details())
    assert etcd_dump(etcd) == before, what


def test_empty_and_oversized_batches(lb: tuple[EtcdServer, LbClient]) -> None:
    _, c = lb
    err = rpc_error(batch, c, [])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("services: ")
    err = rpc_error(batch, c, many("big", 1001, third=13))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("services: ")


def test_batch_and_single_upserts_agree_on_node_ports(lb: tuple[EtcdServer, LbClient]) -> None:
    _, c = lb
    services = [
        service(f"np/s{i}", f"10.14.0.{i + 1}", 80, [("10.2.1.1", 80)], type=2) for i in range(5)
    ]
    services[0].node_port = 30090
    got = [r.service for r in batch(c, services).results]
    ports = [s.node_port for s in got]
    assert ports[0] == 30090
    assert len(set(ports)) == 5
    assert all(30000 <= p <= 30099 for p in ports)
    # Without a node port in the request, an update keeps the one it has.
    again = [r.service for r in batch(c, services).results]
    assert [s.node_port for s in again] == ports
    # A node port another service holds is rejected, naming the item.
    clash = service("np/other", "10.14.0.99", 80, [("10.2.1.1", 80)], type=2, node_port=ports[3])
    err = rpc_error(batch, c, [clash])
    assert err.details().startswith("services[0].node_port: "), err.details()


def test_two_replicas_batching_at_once_never_share_an_id(tmp_path: Path) -> None:
    """Two fresh replicas start their id spaces at the same point, so their
    first chunks collide: the loser commits its chunk one service at a time
    (upsert's retry on a taken id). Every service is stored, ids distinct."""
    tmp = tmp_path
    etcd = EtcdServer(tmp / "etcd").start()
    procs = [
        ServiceProcess(
            "lb", ["--etcd-endpoints", etcd.endpoint], log_dir=tmp / f"r{i}", insecure=True
        )
        for i in range(2)
    ]
    for i in range(2):
        (tmp / f"r{i}").mkdir()
    clients: list[LbClient] = []
    try:
        for p in procs:
            p.start().wait_serving()
            clients.append(LbClient(p.address))
        halves = [many("race", 200, third=20)[i::2] for i in range(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(batch, clients, halves))
        got = [r.service for a in answers for r in a.results]
        assert len(got) == 200
        assert all(r.created for a in answers for r in a.results)
        assert len({s.id for s in got}) == 200
        assert len({s.rev_nat_id for s in got}) == 200
        assert len({b.id for s in got for b in s.backends}) == 200
        listed = clients[0].list().services
        assert sorted((s.name, s.id) for s in listed) == sorted((s.name, s.id) for s in got)
    finally:
        for c in clients:
            c.close()
        for p in procs:
            p.stop()
        etcd.cleanup()
