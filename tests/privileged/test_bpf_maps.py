"""The loader and the map layer: pinning, reuse, layout checks, GC, dumps,
budgets, events."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import replace

import pytest
from harness.bpf import POD_A, POD_B, new_pin_root, private_datapath

from flagella.datapath.bpf import (
    Backend,
    Datapath,
    Direction,
    Frontend,
    LayoutMismatch,
    MapSizes,
    PolicyBudgetExceeded,
    PolicyEntry,
    Programs,
    Service,
    layout_version,
    syscall,
)
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.bpf.lb import svc_key
from flagella.datapath.bpf.mapevents import DELETE, UPDATE
from flagella.datapath.bpf.tables import Tuple, ct_key, monotonic_ns

pytestmark = pytest.mark.privileged


def test_state_survives_a_new_load_of_the_same_folder(
    require_root: None, bpf_programs: Programs
) -> None:
    root = new_pin_root()
    try:
        first = Datapath.load(root, programs=bpf_programs)
        assert first.created
        assert first.folder.name == layout_version(MapSizes())
        POD_A.add(first)
        POD_B.add(first)
        first.policy.apply(POD_A.endpoint_id, [PolicyEntry(POD_B.identity, Direction.EGRESS)], 9)
        first.ipcache.upsert("10.9.0.0/16", 777)
        assert first.test_run("from_container", P.build(POD_A.ip, POD_B.ip)).retval == 7
        first.close()

        second = Datapath.load(root, programs=bpf_programs)
        try:
            assert not second.created
            assert second.endpoints.realized_revision(POD_A.endpoint_id) == 9
            assert second.policy.entry_count(POD_A.endpoint_id) == 1
            assert second.ipcache.entries() == {"10.9.0.0/16": 777}
            assert len(second.conntrack.entries()) == 1
            assert second.metrics.forwarded(Direction.EGRESS) == 1
            # The policy index is rebuilt from the map: a change removes the old key.
            second.policy.apply(POD_A.endpoint_id, [PolicyEntry(3000, Direction.EGRESS)], 10)
            keys = second.policy.keys_of(POD_A.endpoint_id)
            assert [k[0] for k in keys] == [3000]
        finally:
            second.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_pinned_map_of_another_layout_is_refused(
    require_root: None, bpf_programs: Programs
) -> None:
    root = new_pin_root()
    sizes = MapSizes()
    folder = f"{root}/{layout_version(sizes)}"
    try:
        os.makedirs(folder)
        fd = syscall.map_create(syscall.MAP_TYPE_HASH, 16, 8, 10, flags=0, name="endpoints")
        syscall.obj_pin(fd, f"{folder}/endpoints")
        os.close(fd)
        with pytest.raises(LayoutMismatch, match="endpoints"):
            Datapath.load(root, programs=bpf_programs)
        os.unlink(f"{folder}/endpoints")
        # The Maglev map of layout 1 (a flat hash) where a hash of maps belongs.
        fd = syscall.map_create(
            syscall.MAP_TYPE_HASH, 8, 4, 1 << 20, flags=syscall.F_NO_PREALLOC, name="maglev"
        )
        syscall.obj_pin(fd, f"{folder}/maglev")
        os.close(fd)
        with pytest.raises(LayoutMismatch, match="maglev"):
            Datapath.load(root, programs=bpf_programs)
        # Other sizes are another layout: another folder, no clash.
        with private_datapath(bpf_programs, MapSizes(ct=4096), pin_root=root) as dp:
            assert dp.folder.name != layout_version(sizes)
            assert Datapath.stale_layouts(root, MapSizes(ct=4096)) == [
                dp.folder.parent / layout_version(sizes)
            ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_conntrack_gc_and_backend_purge(dp: Datapath) -> None:
    now = monotonic_ns()
    live = L.CtEntry(expires=now + 60 * 10**9, backend_id=3)
    dead = L.CtEntry(expires=now - 1, backend_id=4)
    from flagella.datapath.bpf.tables import ct_key

    t1 = Tuple("10.1.0.1", "10.96.0.1", 1000, 80, 6)
    t2 = Tuple("10.1.0.1", "10.96.0.1", 1001, 80, 6)
    t3 = Tuple("10.1.0.1", "10.1.0.2", 1002, 80, 6)
    dp.conntrack.update(ct_key(t1, L.CT_SCOPE_SERVICE), live)
    dp.conntrack.update(ct_key(t2, L.CT_SCOPE_SERVICE), dead)
    dp.conntrack.update(ct_key(t3, L.CT_SCOPE_EGRESS), L.CtEntry(expires=now + 10**9, backend_id=3))
    assert dp.gc().conntrack == 1
    assert dp.conntrack.lookup(t2, L.CT_SCOPE_SERVICE) is None
    assert dp.conntrack.purge_backends([3]) == 1  # service entries only
    assert dp.conntrack.lookup(t1, L.CT_SCOPE_SERVICE) is None
    assert dp.conntrack.lookup(t3, L.CT_SCOPE_EGRESS) is not None


def test_policy_budget_is_enforced_without_writing(
    require_root: None, bpf_programs: Programs
) -> None:
    with private_datapath(bpf_programs, MapSizes(policy_per_endpoint=8)) as dp:
        POD_A.add(dp)
        ok = [PolicyEntry(POD_B.identity, Direction.EGRESS, protocol=6, port=80)]
        dp.policy.apply(POD_A.endpoint_id, ok, 1)
        too_many = [
            PolicyEntry(POD_B.identity, Direction.EGRESS, protocol=6, port=p)
            for p in range(1, 30, 2)
        ]
        with pytest.raises(PolicyBudgetExceeded):
            dp.policy.apply(POD_A.endpoint_id, too_many, 2)
        assert dp.endpoints.realized_revision(POD_A.endpoint_id) == 1
        assert dp.policy.entry_count(POD_A.endpoint_id) == 2
        # The previous policy still decides.
        assert dp.policy.verdict(POD_A.endpoint_id, POD_B.identity, Direction.EGRESS, 6, 80) == 0
        assert dp.policy.verdict(POD_A.endpoint_id, POD_B.identity, Direction.EGRESS, 6, 3) == int(
            L.DropReason.POLICY_L4
        )


def test_every_map_dumps_to_named_string_fields(dp: Datapath) -> None:
    POD_A.add(dp)
    POD_B.add(dp)
    dp.policy.apply(
        POD_A.endpoint_id, [PolicyEntry(0, Direction.EGRESS, port=1000, end_port=1100)], 1
    )
    dp.policy.apply(POD_B.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)
    dp.ipcache.upsert("fd00:9::/64", 900)
    dp.upsert_service(
        Service(
            1,
            (Frontend("10.96.0.1", 53, 17, 1),),
            (Backend(1, POD_B.ip, 53, 17),),
            maglev=True,
            maglev_table=(1, 1, 1),
            affinity_timeout=30,
            source_ranges=("10.0.0.0/8",),
        )
    )
    dp.test_run("from_container", P.build(POD_A.ip, "10.96.0.1", proto=17, dport=53))
    names = {s.name for s in dp.map_status()}
    assert names == {*dp.maps, "events"}
    for name in dp.maps:
        rows = dp.dump(name, limit=50)
        for key, value in rows:
            assert key
            assert value
            assert all(isinstance(x, str) for x in (*key, *key.values(), *value, *value.values()))
    assert {"ip": POD_A.ip} in [k for k, _ in dp.dump("endpoints")]
    assert {"prefix": "fd00:9::/64"} in [k for k, _ in dp.dump("ipcache")]
    ports = {k["port"] for k, _ in dp.dump("policy") if k["protocol"] == "tcp"}
    assert ports == {"1000-1007", "1008-1023", "1024-1087", "1088-1095", "1096-1099", "1100"}
    assert {"cidr": "10.0.0.0/8", "service_id": "1"} in [k for k, _ in dp.dump("srcrange")]
    status = {s.name: s for s in dp.map_status()}
    assert status["endpoints"].entries == 2
    assert status["ct"].max_entries == MapSizes().ct
    assert status["policy"].type == "lpm_trie"


def test_events_of_drops_can_be_switched_off(dp: Datapath) -> None:
    from flagella.datapath.bpf import NodeConfig

    POD_A.add(dp)
    with dp.events() as ev:
        dp.test_run("from_container", P.build(POD_A.ip, POD_B.ip))
        flows = ev.poll(100)
        assert [f.drop_reason for f in flows] == [L.DropReason.POLICY_NOT_READY]
        assert flows[0].time_ns > 1_600_000_000 * 10**9
        dp.config.write(NodeConfig(drop_events=False))
        dp.test_run("from_container", P.build(POD_A.ip, POD_B.ip))
        assert ev.read() == []
    assert dp.metrics.drops(L.DropReason.POLICY_NOT_READY) == 2


def test_entry_counts_of_hash_maps_across_batches_and_of_arrays(dp: Datapath) -> None:
    """count() reads hash maps in batch lookups without decoding them: the
    same number as a walk of the entries, over several batches; arrays
    count every slot (what ListMaps reports)."""
    assert dp.backends.count() == 0
    dp.backends.upsert_many(
        Backend(i + 1, f"10.3.{i // 250}.{i % 250 + 1}", 8080) for i in range(9000)
    )
    assert dp.backends.count() == 9000 == sum(1 for _ in dp.backends.items())
    dp.backends.delete_many([L.U32(i + 1) for i in range(0, 9000, 2)])
    assert dp.backends.count() == 4500 == len(list(dp.backends.keys()))
    metrics = dp.maps["metrics"]
    assert metrics.count() == metrics.max_entries == 768
    status = {m.name: m for m in dp.map_status()}
    assert status["backends"].entries == 4500
    assert status["metrics"].entries == 768


def test_writers_keep_map_entries_ops_and_gc_families(dp: Datapath) -> None:
    """Map pressure and operations come from counts the writers and the GC
    keep (no walk at scrape time): they match a walk of the map; the
    per-CPU metrics map read in one batch equals slot-by-slot lookups."""
    dp.backends.upsert_many(Backend(i + 1, f"10.4.0.{i + 1}", 80) for i in range(10))
    dp.backends.upsert(Backend(1, "10.4.0.1", 81))  # a replacement: no new entry
    dp.backends.remove(2)
    dp.backends.remove(2)  # absent: a success, no change
    assert dp.backends.stats.entries == 9 == dp.backends.count()
    assert dp.backends.stats.ops == {("update", "success"): 11, ("delete", "success"): 2}
    assert dp.entries_in_use("backends") == 9
    assert dp.entries_in_use("config") == 1
    assert dp.entries_in_use("metrics") == 768

    now = monotonic_ns()
    for i, (src, dst) in enumerate([("10.0.0.1", "10.0.0.2"), ("fd00::1", "fd00::2")] * 2):
        e = dp.conntrack.value_type()
        e.expires = now - 1 if i < 2 else now + 10**12
        dp.conntrack.update(ct_key(Tuple(src, dst, 1000 + i, 80, 6), 0), e)
    stats = dp.gc(now)
    assert stats.ct_deleted == {"ipv4": 1, "ipv6": 1}
    assert stats.ct_alive == {"ipv4": 1, "ipv6": 1}
    assert stats.conntrack == 2
    assert dp.conntrack.stats.entries == 2 == dp.conntrack.count()
    dp.conntrack.delete_many(k for k, _ in dp.conntrack.items())  # a purge
    assert dp.conntrack.stats.entries == 0 == dp.conntrack.count()

    for slot, packets in ((3, 5), (300, 7)):
        dp.metrics.update(L.U32(slot), L.MetricsValue(packets=packets, bytes=packets * 100))
    batch = {k.value: (v.packets, v.bytes) for k, v in dp.metrics.items()}
    assert len(batch) == 768
    for slot in (0, 3, 300, 767):
        one = dp.metrics.get(L.U32(slot))
        assert one is not None
        assert batch[slot] == (one.packets, one.bytes)
    assert batch[3] == (5, 500)
    assert batch[300] == (7, 700)


def test_every_write_is_a_map_event_in_order_with_its_outcome(bpf_programs: Programs) -> None:
    """The map layer records each write (single, batch, delete) with its
    key, value and outcome, in one order over every map, decoded as DumpMap
    decodes entries; a refused write is an error with the kernel's errno;
    each map keeps its last N writes only."""
    with private_datapath(bpf_programs, map_event_history=4) as dp:
        backends = [Backend(1, "10.5.0.1", 8080), Backend(2, "10.5.0.2", 8080)]
        fe = Frontend("10.96.5.1", 80, L.PROTO_TCP, 7)
        dp.upsert_service(Service(service_id=7, frontends=(fe,), backends=tuple(backends)))

        def events(name: str) -> list[tuple[int, int, bool, int, dict[str, str], dict[str, str]]]:
            m = dp.maps[name]
            assert m.events is not None
            out = []
            for e in m.events.after(0):
                key, value = m.decode_raw(e.key, e.value)
                out.append((e.seq, e.action, e.ok, e.errno, key, value))
            return out

        written = events("backends")
        assert [(v["address"], v["port"]) for *_, v in written] == [
            ("10.5.0.1", "8080"),
            ("10.5.0.2", "8080"),
        ]
        svc = events("services")
        # The backend slots, then the service entry (what packets look up first).
        assert [(k["slot"], v["count"]) for *_, k, v in svc] == [("1", "0"), ("2", "0"), ("0", "2")]
        assert all(a == UPDATE and ok and not err for _, a, ok, err, _, _ in svc)
        assert max(s for s, *_ in written) < svc[-1][0]
        assert events("revnat")[0][0] < svc[0][0]

        dp.backends.remove(2)
        dp.backends.remove(2)  # absent: an ok delete that names ENOENT
        assert [
            (a, ok, err, k["backend_id"]) for _, a, ok, err, k, _ in events("backends")[-2:]
        ] == [
            (DELETE, True, 0, "2"),
            (DELETE, True, errno.ENOENT, "2"),
        ]

        dp.ipcache.upsert("10.9.0.0/16", 300)
        k = next(iter(dp.ipcache.keys()))
        v = dp.ipcache.get(k)
        assert v is not None
        with pytest.raises(syscall.BpfError):
            dp.ipcache.update(k, v, flags=syscall.NOEXIST)
        _, action, ok, err, key, value = events("ipcache")[-1]
        assert (action, ok, err) == (UPDATE, False, errno.EEXIST)
        assert key["prefix"] == "10.9.0.0/16"
        assert value["identity"] == "300"

        # A batch of 10: each entry an event; only the last 4 are kept.
        dp.backends.upsert_many(Backend(i, f"10.6.0.{i}", 80) for i in range(10, 20))
        kept = events("backends")
        assert [k["backend_id"] for *_, k, _ in kept] == ["16", "17", "18", "19"]
        assert [s for s, *_ in kept] == sorted(s for s, *_ in kept)
        assert len(dp.backends.events or ()) == 4


def test_endpoint_entries_are_found_without_a_walk_and_follow_every_write(
    require_root: None, bpf_programs: Programs
) -> None:
    """Endpoints indexes each endpoint's keys (built by one walk, then kept
    by its writes): by_id and the policy state it sets agree with a walk of
    the map through address changes, removals, another endpoint taking an
    address, and a new load of the same pins (index rebuilt from the map)."""

    def walked(dp: Datapath, endpoint_id: int) -> list[str]:
        return sorted(s.ip for s in dp.endpoints.all() if s.endpoint_id == endpoint_id)

    def indexed(dp: Datapath, endpoint_id: int) -> list[str]:
        return sorted(s.ip for s in dp.endpoints.by_id(endpoint_id))

    macs = {"mac": "02:00:00:00:00:01", "node_mac": "02:00:00:00:00:02", "ifindex": 1}
    root = new_pin_root()
    try:
        first = Datapath.load(root, programs=bpf_programs)
        eps = first.endpoints
        eps.upsert(1, ["10.9.1.1", "fd00::1"], identity=100, **macs)
        eps.upsert(2, ["10.9.1.2"], identity=200, **macs)
        assert indexed(first, 1) == walked(first, 1) == ["10.9.1.1", "fd00::1"]
        eps.upsert(1, ["10.9.1.3"], identity=100, **macs)  # its addresses replaced
        eps.upsert(2, ["10.9.1.2", "10.9.1.1"], identity=200, **macs)  # takes a freed one
        for ep in (1, 2, 3):
            assert indexed(first, ep) == walked(first, ep)
        assert first.policy.apply(2, [PolicyEntry(100, Direction.INGRESS)], 5) == 1  # keys
        assert {s.ip: s.policy_revision for s in eps.all()} == {
            "10.9.1.3": 0,
            "10.9.1.2": 5,
            "10.9.1.1": 5,
        }
        assert eps.set_not_ready(2) == 2
        assert eps.remove(1) == 1
        assert indexed(first, 1) == walked(first, 1) == []
        first.close()

        second = Datapath.load(root, programs=bpf_programs)
        try:
            assert indexed(second, 2) == walked(second, 2) == ["10.9.1.1", "10.9.1.2"]
            assert second.endpoints.realized_revision(2) is None  # not ready, as left
            second.policy.apply(2, [], 6, ingress_enforced=False, egress_enforced=False)
            assert second.endpoints.realized_revision(2) == 6
        finally:
            second.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_local_traffic_policy_entries_come_and_go(dp: Datapath) -> None:
    """An externalTrafficPolicy Local frontend: its own entry (all backends)
    flagged external-local, and a scope-local entry with this node's active
    backends; none local: count 0; no longer Local, then deleted: nothing
    of the local scope is left."""
    cluster_ip = Frontend("10.96.0.5", 80, L.PROTO_TCP, 5)
    lb_ip = Frontend("192.0.2.10", 80, L.PROTO_TCP, 5 | 1 << 24, nodeport=True, local_only=True)
    backends = (Backend(1, "10.0.0.1", 80, local=True), Backend(2, "10.0.0.2", 80))
    svc = Service(5, (cluster_ip, lb_ip), backends)

    def rows() -> dict[tuple[str, str, str], dict[str, str]]:
        return {
            (k["address"], k["scope"], k["slot"]): v
            for k, v in dp.dump("services")
            if k["address"] in ("10.96.0.5", "192.0.2.10")
        }

    dp.upsert_service(svc)
    got = rows()
    assert set(got) == {
        ("10.96.0.5", "all", "0"),
        ("10.96.0.5", "all", "1"),
        ("10.96.0.5", "all", "2"),
        ("192.0.2.10", "all", "0"),
        ("192.0.2.10", "all", "1"),
        ("192.0.2.10", "all", "2"),
        ("192.0.2.10", "local", "0"),
        ("192.0.2.10", "local", "1"),
    }
    assert "external-local" in got[("192.0.2.10", "all", "0")]["flags"]
    assert "external-local" not in got[("10.96.0.5", "all", "0")]["flags"]
    assert got[("192.0.2.10", "local", "0")]["count"] == "1"
    assert got[("192.0.2.10", "local", "1")]["backend_id"] == "1"

    dp.upsert_service(replace(svc, backends=(replace(backends[0], local=False), backends[1])))
    got = rows()
    assert got[("192.0.2.10", "local", "0")]["count"] == "0"
    assert ("192.0.2.10", "local", "1") not in got

    dp.upsert_service(replace(svc, frontends=(cluster_ip, replace(lb_ip, local_only=False))))
    got = rows()
    assert not [k for k in got if k[1] == "local"]
    assert "external-local" not in got[("192.0.2.10", "all", "0")]["flags"]

    # A local entry left by a crash before the flag was written goes at the
    # next write of the frontend.
    dp.services.update(
        svc_key("192.0.2.10", 80, L.PROTO_TCP, 0, L.SVC_SCOPE_LOCAL),
        L.SvcValue(count=0, rev_nat_id=lb_ip.rev_nat_id, service_id=5),
    )
    assert ("192.0.2.10", "local", "0") in rows()
    dp.upsert_service(replace(svc, frontends=(cluster_ip, replace(lb_ip, local_only=False))))
    assert not [k for k in rows() if k[1] == "local"]

    dp.upsert_service(svc)
    assert ("192.0.2.10", "local", "1") in rows()
    dp.delete_service(5)
    assert rows() == {}
