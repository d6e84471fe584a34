"""Several ipam replicas writing at once: no IP is handed out twice, none is
lost, and a replica killed with SIGKILL in the middle of a burst loses
nothing that was granted."""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from ipam_support import V4, Ipam, spawn_ipam, wait_for

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

NODES = ("scale-1", "scale-2", "scale-3", "scale-4")
# /20 per node: 4093 usable, room for 2,500 each.
POOL = ("--cluster-cidr", "10.100.0.0/16", "--node-mask-size-v4", "20")


def register_concurrently(clients: list[Ipam], names: tuple[str, ...]) -> dict[str, str]:
    cidrs: dict[str, str] = {}

    def register(i: int, name: str) -> None:
        cidrs[name] = clients[i % len(clients)].register(name).pod_cidrs[0]

    threads = [threading.Thread(target=register, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(cidrs.values())) == len(names)
    return cidrs


def test_three_replicas_16_clients_10000_allocations_no_duplicate_none_lost(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    clients = [spawn_ipam(spawn, etcd, *POOL, "--log-level", "warning")[1] for _ in range(3)]
    cidrs = register_concurrently(clients, NODES)
    total, workers = 10_000, 16
    granted: list[list[tuple[str, str, str]]] = [[] for _ in range(workers)]
    errors: list[str] = []

    def worker(w: int) -> None:
        client = clients[w % len(clients)]
        for i in range(w, total, workers):
            node, cid = NODES[i % len(NODES)], f"scale-c{i}"
            try:
                got = client.allocate(node, cid, [V4])
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
                continue
            granted[w].extend((a.node, a.ip, a.owner.container_id) for a in got)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert errors == []
    flat = [g for chunk in granted for g in chunk]
    assert len(flat) == total
    # Zero duplicates: no IP twice (node CIDRs are disjoint, so across nodes too).
    assert len({ip for _, ip, _ in flat}) == total
    for node, ip, _ in flat:
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(cidrs[node])
    # Zero lost: etcd holds exactly what was granted, each IP with its owner.
    stored = {(a.node, a.ip, a.owner.container_id) for a in clients[1].allocations()}
    assert stored == set(flat)
    print(f"10,000 allocations by 16 clients through 3 replicas in {elapsed:.1f}s")


def test_kill9_a_replica_mid_burst_loses_nothing_and_frees_only_expired_reservations(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    expiration = 8.0
    victim, a = spawn_ipam(spawn, etcd, *POOL)
    _, b = spawn_ipam(spawn, etcd, *POOL)
    register_concurrently([a, b], NODES[:2])
    lock = threading.Lock()
    kept: dict[str, set[str]] = {}  # granted without expiration
    reserved: dict[str, set[str]] = {}  # granted with an expiration, never committed
    granted_at: dict[str, float] = {}
    unknown: dict[str, bool] = {}  # failed calls: owner -> was a reservation
    stop = threading.Event()
    count = [0]

    def worker(w: int) -> None:
        client = a if w % 2 == 0 else b
        i = 0
        while not stop.is_set():
            i += 1
            cid = f"k9-{w}-{i}"
            is_res = i % 3 == 0
            node = NODES[i % 2]
            try:
                got = client.allocate(node, cid, [V4], expiration=expiration if is_res else 0)
            except grpc.RpcError:
                with lock:
                    unknown[cid] = is_res
                time.sleep(0.05)
                continue
            with lock:
                (reserved if is_res else kept)[cid] = {f"{x.node}/{x.ip}" for x in got}
                granted_at[cid] = time.monotonic()
                count[0] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: count[0] >= 600, timeout=60, interval=0.01)
    victim.kill9()
    killed_at = count[0]
    wait_for(lambda: count[0] >= killed_at + 600, timeout=60, interval=0.01)
    stop.set()
    for t in threads:
        t.join()
    assert unknown, "the kill interrupted no call: it was not mid-burst"

    def held(client: Ipam) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for x in client.allocations():
            out.setdefault(x.owner.container_id, set()).add(f"{x.node}/{x.ip}")
        return out

    def check_all_granted_held(client: Ipam) -> None:
        now_held = held(client)
        horizon = time.monotonic() - expiration + 1.0
        for cid, ips in kept.items():
            assert now_held.get(cid) == ips, cid
        for cid, ips in reserved.items():
            if granted_at[cid] > horizon:  # not expired yet
                assert now_held.get(cid) == ips, cid
        all_ips = [ip for ips in now_held.values() for ip in ips]
        assert len(all_ips) == len(set(all_ips))

    # Everything granted, before and after the kill, is held.
    check_all_granted_held(b)
    victim.start()
    victim.wait_serving()
    check_all_granted_held(a)

    # Once they expire, the reservations are freed, and nothing else is.
    expiring = set(reserved) | {cid for cid, is_res in unknown.items() if is_res}
    wait_for(lambda: not set(held(a)) & expiring, timeout=30)
    final = held(b)
    assert set(kept) <= set(final)
    for cid, ips in kept.items():
        assert final[cid] == ips
    extra = set(final) - set(kept)
    # Calls cut by the kill may have been written before the reply was lost:
    # only committed (non-expiring) ones can remain.
    assert all(cid in unknown and not unknown[cid] for cid in extra), extra
    # A retry of such a call gets the same IP (Allocate is idempotent per owner).
    for cid in extra:
        node = next(iter(final[cid])).split("/")[0]
        assert {f"{x.node}/{x.ip}" for x in a.allocate(node, cid, [V4])} == final[cid]
    # The restarted replica allocates on without handing out a held IP.
    fresh = {f"{x.node}/{x.ip}" for i in range(50) for x in a.allocate(NODES[i % 2], f"after-{i}")}
    assert not fresh & {ip for ips in final.values() for ip in ips}
