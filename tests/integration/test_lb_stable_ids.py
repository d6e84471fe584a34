"""Stable ids: kept across restarts and crashes, never shared, safe with two
replicas writing at once; etcd down gives UNAVAILABLE."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.lb import LbClient, etcd_dump, rpc_error, service, wait_for
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]


def all_ids(services: list[pb.Service]) -> tuple[list[int], list[int], list[int]]:
    return (
        [s.id for s in services],
        [s.rev_nat_id for s in services],
        [b.id for s in services for b in s.backends],
    )


def test_ids_survive_a_crash_and_a_restart_and_are_never_shared(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    first = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    c = LbClient(first.address)
    for i in range(12):
        c.upsert(
            service(
                f"keep/s{i}",
                f"10.97.0.{i + 1}",
                80,
                [(f"10.5.{i}.{j + 1}", 8080) for j in range(i % 4 + 1)],
                type=pb.SERVICE_TYPE_NODE_PORT if i % 3 == 0 else pb.SERVICE_TYPE_CLUSTER_IP,
            )
        )
    before = {s.name: s for s in c.list().services}
    c.delete("keep/s5")
    del before["keep/s5"]
    c.close()
    first.kill9()  # a crash: nothing is flushed on the way out

    second = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    c = LbClient(second.address)
    after = {s.name: s for s in c.list().services}
    assert after == before
    # New services get ids nobody has, and none of the freed one's either.
    for i in range(3):
        c.upsert(
            service(
                f"keep/new{i}", f"10.97.1.{i + 1}", 80, [(f"10.6.{i}.1", 80), ("10.5.0.1", 8080)]
            )
        )
    services = c.list().services
    svc_ids, rev_nat_ids, backend_ids = all_ids(list(services))
    assert len(set(svc_ids)) == len(svc_ids)
    assert len(set(rev_nat_ids)) == len(rev_nat_ids)
    assert len(set(backend_ids)) == len(backend_ids)  # 10.5.0.1:8080 is in two services
    old_svc_ids, _, old_backend_ids = all_ids(list(before.values()))
    new = [s for s in services if s.name.startswith("keep/new")]
    assert {s.id for s in new}.isdisjoint(old_svc_ids)
    assert {b.id for s in new for b in s.backends}.isdisjoint(old_backend_ids)
    second.stop()  # a clean stop, then again
    third = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    c.close()
    c = LbClient(third.address)
    assert list(c.list().services) == list(services)
    c.close()


def test_two_replicas_writing_at_once_never_share_an_id_or_a_frontend(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    replicas = [LbClient(spawn("lb", "--etcd-endpoints", etcd.endpoint).address) for _ in range(2)]

    def create(i: int) -> pb.Service:
        c = replicas[i % 2]
        backends = [(f"10.7.{i}.{j + 1}", 80) for j in range(1 + i % 70)]
        return c.upsert(
            service(f"rep/s{i}", f"10.98.{i // 200}.{i % 200 + 1}", 80, backends)
        ).service

    with ThreadPoolExecutor(16) as pool:
        made = list(pool.map(create, range(120)))
    svc_ids, rev_nat_ids, backend_ids = all_ids(made)
    assert len(set(svc_ids)) == 120
    assert len(set(rev_nat_ids)) == 120
    assert len(set(backend_ids)) == len(backend_ids) == sum(1 + i % 70 for i in range(120))
    # What each replica answered is what is stored.
    stored = {s.name: s for s in replicas[0].list().services}
    assert {s.name: s for s in made} == stored

    # Both replicas race for the same frontend under different names: one wins.
    def claim(i: int) -> str:
        try:
            replicas[i % 2].upsert(service(f"rep/claim{i}", "10.98.9.9", 443))
        except grpc.RpcError as exc:
            return f"{exc.code().name} {exc.details()}"
        return "won"

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(claim, range(8)))
    assert results.count("won") == 1
    lost = [r for r in results if r != "won"]
    assert all(r.startswith("INVALID_ARGUMENT service.frontend: ") for r in lost), lost
    keys = etcd_dump(etcd, "flagella/lb/v1/frontends/TCP/10.98.9.9/")
    assert len(keys) == 1

    # Both replicas update the same services concurrently: ids stay.
    def update(i: int) -> pb.Service:
        name = f"rep/s{i % 10}"
        backends = [(f"10.7.{i % 10}.{j + 1}", 80) for j in range(i % 5 + 1)]
        return replicas[i % 2].upsert(service(name, f"10.98.0.{i % 10 + 1}", 80, backends)).service

    with ThreadPoolExecutor(8) as pool:
        updated = list(pool.map(update, range(40)))
    assert all(u.id == stored[u.name].id for u in updated)
    final = replicas[1].list().services
    _, _, backend_ids = all_ids(list(final))
    assert len(set(backend_ids)) == len(backend_ids)
    for c in replicas:
        c.close()


def test_etcd_down_is_unavailable_and_recovers(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    proc = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--etcd-timeout", "1")
    c = LbClient(proc.address)
    made = c.upsert(service("down/a", "10.99.0.1", 80, [("10.8.0.1", 80)])).service
    stream = c.watch(timeout=120)
    assert [next(stream).kind for _ in range(3)] == [
        pb.ServiceEvent.KIND_RESET,
        pb.ServiceEvent.KIND_UPSERT,
        pb.ServiceEvent.KIND_SYNCED,
    ]
    etcd.stop()
    for call in (
        lambda: c.upsert(service("down/b", "10.99.0.2", 80)),
        lambda: c.get("down/a"),
        c.list,
        lambda: c.delete("down/a"),
    ):
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    etcd.start()
    wait_for(lambda: _answers(c))
    assert c.get("down/a") == made
    b = c.upsert(service("down/b", "10.99.0.2", 80))
    assert b.created
    # The watch stream rode out the outage: the change arrives on it.
    ev = next(stream)
    assert (ev.kind, ev.service) == (pb.ServiceEvent.KIND_UPSERT, b.service)
    stream.cancel()
    c.close()


def _answers(c: LbClient) -> bool:
    try:
        c.list()
    except grpc.RpcError:
        return False
    return True


def test_a_replica_with_another_maglev_seed_refuses_to_start(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    spawn("lb", "--etcd-endpoints", etcd.endpoint)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flagella.lb",
            "--listen",
            "127.0.0.1:0",
            "--etcd-endpoints",
            etcd.endpoint,
            "--maglev-hash-seed",
            "AAAAAAAAAAAAAAAA",
            "--insecure",
            *etcd.service_args("lb"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "every lb replica must use the same seed" in out.stderr


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--maglev-table-size", "16383"], "invalid --maglev-table-size: 16383 is not one of"),
        (["--maglev-hash-seed", "abc"], "invalid --maglev-hash-seed"),
        (["--node-port-range", "32767-30000"], "invalid --node-port-range"),
        (["--lb-algorithm", "roundrobin"], "invalid --lb-algorithm"),
    ],
)
def test_bad_configuration_exits_2(args: list[str], reason: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flagella.lb", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert reason in out.stderr
