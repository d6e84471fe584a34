"""Services written in batches into real BPF maps: Datapath.apply_services
(what one reconciler pass of the datapath's services does, on its map
thread) and the services reconciler with the datapath's ServiceOps."""

from __future__ import annotations

import types

import pytest
from harness.bpf import POD_A

from flagella.common.reconcile import Reconciler
from flagella.datapath.bpf import (
    Backend,
    Datapath,
    Frontend,
    Programs,
    Service,
    frontend_rev_nat_id,
)
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.service import MapWriter, ServiceOps

pytestmark = pytest.mark.privileged


def numbered(i: int, backends: int = 2, **kw: object) -> Service:
    """Service 2000 + i at 10.99.<i/250>.<i%250 + 1>:80, backends 10.2.<i/250>.<k>."""
    sid = 2000 + i
    return Service(
        service_id=sid,
        frontends=(
            Frontend(f"10.99.{i // 250}.{i % 250 + 1}", 80, 6, frontend_rev_nat_id(sid, 0)),
        ),
        backends=tuple(
            Backend(10 * sid + k, f"10.2.{i // 250}.{k + 1}", 8080) for k in range(backends)
        ),
        **kw,  # type: ignore[arg-type]
    )


def reaches(dp: Datapath, vip: str, sport: int) -> str:
    out = dp.test_run("from_container", P.build(POD_A.ip, vip, sport=sport, dport=80))
    assert out.retval == L.TC_ACT_OK
    return str(P.parse(out.data).dst)


def rev_nat(dp: Datapath, rev_nat_id: int) -> str | None:
    v = dp.revnat.get(L.U32(rev_nat_id))
    return None if v is None else L.get_addr(v.addr)


def test_apply_services_writes_a_batch_and_isolates_a_bad_one(dp: Datapath) -> None:
    """300 services and a delete in one call: every good one is in the maps
    and carries traffic, the bad one (Maglev without a table) gets its own
    error and no frontend, the deleted one's frontend and rev-NAT are gone."""
    POD_A.add(dp)
    dp.policy.apply(POD_A.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)
    old = numbered(999)
    dp.upsert_service(old)
    assert dp.services.service_ids() == {old.service_id}

    services = [numbered(i) for i in range(300)]
    services[150] = numbered(150, maglev=True)  # no table: cannot be written
    changes: list[tuple[int, Service | None, list[int]]] = [(s.service_id, s, []) for s in services]
    changes.insert(100, (old.service_id, None, [old.frontends[0].rev_nat_id]))
    outcomes = dp.apply_services(changes)

    assert len(outcomes) == len(changes)
    failed = [(changes[i][0], o) for i, o in enumerate(outcomes) if o is not None]
    assert len(failed) == 1
    assert failed[0][0] == 2150
    assert isinstance(failed[0][1], ValueError)
    good = {s.service_id for s in services} - {2150}
    assert dp.services.service_ids() == good
    # One frontend entry and two backend slots per good service.
    assert dp.services.count() == 3 * len(good)
    assert dp.services.frontend("10.99.0.151", 80, 6) is None
    assert dp.services.frontend(old.frontends[0].address, 80, 6) is None
    assert rev_nat(dp, old.frontends[0].rev_nat_id) is None
    for i in (0, 149, 151, 299):
        s = services[i]
        assert rev_nat(dp, s.frontends[0].rev_nat_id) == s.frontends[0].address
        assert dp.backends.lookup(s.backends[1].id) == (s.backends[1].address, 8080)
        dst = reaches(dp, s.frontends[0].address, 41000 + i)
        assert dst in {b.address for b in s.backends}, f"service {i}"


def test_apply_services_moves_a_frontend_and_drops_a_maglev_table(
    dp: Datapath, bpf_programs: Programs
) -> None:
    """In one batch, after a restart (new process on the same pins): a
    frontend leaves one service for another listed after it, a service
    that had a Maglev table written by the previous process loses it, and
    two services naming the same frontend are written in order (the last
    one wins)."""
    POD_A.add(dp)
    dp.policy.apply(POD_A.endpoint_id, [], 1, ingress_enforced=False, egress_enforced=False)
    x, y, z = (Frontend(f"10.96.7.{i}", 80, 6, frontend_rev_nat_id(60 + i, 0)) for i in range(3))
    a_backends = (Backend(600, "10.2.7.1", 8080),)
    b_backends = (Backend(610, "10.2.7.2", 8080),)
    dp.upsert_service(Service(60, (x, y), a_backends, maglev=True, maglev_table=(600,) * 251))
    dp.upsert_service(Service(61, (z,), b_backends))
    assert dp.maglev.service_ids() == [60]

    again = Datapath.load(dp.folder.parent, programs=bpf_programs, sizes=dp.sizes)
    try:
        outcomes = again.apply_services(
            [
                (60, Service(60, (x,), a_backends), []),
                (61, Service(61, (z, y), b_backends), []),
            ]
        )
        assert outcomes == [None, None]
        assert again.maglev.service_ids() == []
        assert again.services.frontends_of(60) == [(x.address, 80, 6)]
        assert again.services.frontends_of(61) == [(y.address, 80, 6), (z.address, 80, 6)]
        y_entry = again.services.frontend(y.address, 80, 6)
        assert y_entry is not None
        assert y_entry.service_id == 61
        assert reaches(again, y.address, 42000) == "10.2.7.2"
        assert reaches(again, x.address, 42001) == "10.2.7.1"

        w = Frontend("10.96.7.9", 80, 6, frontend_rev_nat_id(70, 0))
        outcomes = again.apply_services(
            [
                (70, Service(70, (w,), (Backend(700, "10.2.7.3", 8080),)), []),
                (71, Service(71, (w,), (Backend(710, "10.2.7.4", 8080),)), []),
            ]
        )
        assert outcomes == [None, None]
        w_entry = again.services.frontend(w.address, 80, 6)
        assert w_entry is not None
        assert w_entry.service_id == 71
        assert reaches(again, w.address, 42002) == "10.2.7.4"
    finally:
        again.close()


async def test_services_reconciler_writes_through_batches(dp: Datapath) -> None:
    """The datapath's services reconciler with its ServiceOps on real maps:
    500 services realized in one pass of few map-thread trips; a rev-NAT id
    freed by one service and taken by another in the same pass stays
    (whatever the order of the two changes in the pass)."""
    writer = MapWriter()
    ops = ServiceOps(types.SimpleNamespace(bpf=dp, writer=writer))  # type: ignore[arg-type]
    rec: Reconciler[int, Service] = Reconciler("services", ops, batch_size=200)
    try:
        for i in range(500):
            rec.upsert(2000 + i, numbered(i, backends=1))
        assert await rec.reconcile_once() is None
        assert rec.realized_revision == rec.revision
        assert dp.services.count() == 2 * 500
        assert set(ops.applied) == {2000 + i for i in range(500)}

        # Service 2000 goes; 3000 takes its rev-NAT id. 3000's change comes
        # first in the pass, so a delete applied blindly after it would
        # remove the entry 3000 needs.
        freed = frontend_rev_nat_id(2000, 0)
        taker = Service(
            service_id=3000,
            frontends=(Frontend("10.99.9.9", 80, 6, freed),),
            backends=(Backend(30000, "10.2.9.1", 8080),),
        )
        rec.upsert(3000, taker)
        rec.delete(2000)
        assert await rec.reconcile_once() is None
        assert rev_nat(dp, freed) == "10.99.9.9"
        assert dp.services.frontend("10.99.0.1", 80, 6) is None
        assert 2000 not in ops.applied
        assert ops.applied[3000] == taker
        # A plain delete of a service removes its rev-NAT entry.
        rec.delete(2001)
        assert await rec.reconcile_once() is None
        assert rev_nat(dp, frontend_rev_nat_id(2001, 0)) is None
    finally:
        writer.close()
