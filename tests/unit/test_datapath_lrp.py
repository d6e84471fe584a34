"""The datapath's local redirects (flagella.datapath.lrp), pure logic: what
the services reconciler is asked to hold as policies, services and local
endpoints come and go. Traffic: tests/e2e/test_lrp.py."""

from __future__ import annotations

from collections.abc import Iterable

from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.common.reconcile import Reconciler
from flagella.datapath.bpf import Backend, Frontend, Service
from flagella.datapath.lrp import LOCAL_ID_BASE, LocalEndpoint, LocalRedirects
from flagella.datapath.lrpcodec import LrpCodec

TCP, UDP = 6, 17


class NoOps:
    async def update(self, key: int, value: Service) -> None: ...

    async def delete(self, key: int) -> None: ...

    async def list_actual(self) -> Iterable[int]:
        return ()


def svc(sid: int, name: str, address: str, port: int = 53, proto: int = UDP) -> Service:
    return Service(
        service_id=sid,
        frontends=(Frontend(address, port, proto, sid),),
        backends=(Backend(sid * 64, "10.0.9.9", port, proto, 1),),
        maglev=True,
        maglev_table=(sid * 64,) * 7,
        name=name,
    )


def lrp_event(**frontend: object) -> pb.LrpEvent:
    p = pb.LocalRedirectPolicy(name="dns", namespace="kube-system")
    if "ip" in frontend:
        p.redirect_frontend.address_matcher.ip = str(frontend["ip"])
        p.redirect_frontend.address_matcher.to_ports.add(port=53, protocol=pb.PROTOCOL_UDP)
    else:
        p.redirect_frontend.service_matcher.service_name = "kube-dns"
    p.redirect_backend.local_endpoint_selector.match_labels["k8s-app"] = "node-local-dns"
    p.redirect_backend.to_ports.add(port=5353, protocol=pb.PROTOCOL_UDP)
    return pb.LrpEvent(kind=pb.LrpEvent.KIND_UPSERT, lrp=p)


DNS_POD = LocalEndpoint(
    ("10.0.1.5", "fd00::5"),
    {"k8s-app": "node-local-dns", "io.kubernetes.pod.namespace": "kube-system"},
)
OTHER_NS = LocalEndpoint(
    ("10.0.1.6",), {"k8s-app": "node-local-dns", "io.kubernetes.pod.namespace": "default"}
)


def test_service_matcher_redirects_only_with_a_local_backend() -> None:
    rec: Reconciler[int, Service] = Reconciler("services", NoOps())
    lr = LocalRedirects(rec)
    codec = LrpCodec()
    kube_dns = svc(7, "kube-system/kube-dns:dns", "10.96.0.10")
    other = svc(8, "kube-system/kube-dns-other", "10.96.0.11")
    lr.services_target.replace_all({7: kube_dns, 8: other})
    ev = lrp_event()
    redirect = codec.decode(ev)
    assert redirect is not None
    lr.lrps_target.upsert(codec.key(ev), redirect)
    # No local backend (one in another namespace does not count): as the lb says.
    lr.set_endpoints([OTHER_NS])
    assert rec.desired() == {7: kube_dns, 8: other}

    lr.set_endpoints([OTHER_NS, DNS_POD])
    got = rec.get(7)
    assert got is not None
    assert got.frontends == kube_dns.frontends  # same ids: replies come from the ClusterIP
    assert [(b.address, b.port, b.protocol) for b in got.backends] == [("10.0.1.5", 5353, UDP)]
    assert got.backends[0].id > LOCAL_ID_BASE
    assert not got.maglev
    assert rec.get(8) == other

    # The lb changes the service: the redirect follows the new frontend.
    moved = svc(7, "kube-system/kube-dns:dns", "10.96.0.12")
    lr.services_target.upsert(7, moved)
    got = rec.get(7)
    assert got is not None
    assert got.frontends == moved.frontends
    assert got.backends[0].address == "10.0.1.5"

    # The pod goes: the service's own backends at once, its local id released.
    lr.set_endpoints([OTHER_NS])
    assert rec.get(7) == moved
    assert lr.released == {got.backends[0].id}


def test_address_matcher_gets_a_service_of_the_nodes_own() -> None:
    rec: Reconciler[int, Service] = Reconciler("services", NoOps())
    lr = LocalRedirects(rec)
    codec = LrpCodec()
    lr.services_target.replace_all({})
    ev = lrp_event(ip="169.254.20.10")
    redirect = codec.decode(ev)
    assert redirect is not None
    lr.lrps_target.upsert(codec.key(ev), redirect)
    assert rec.desired() == {}  # no local backend: the address as it is
    lr.set_endpoints([DNS_POD])
    (sid,) = rec.keys()
    own = rec.get(sid)
    assert own is not None
    assert sid > LOCAL_ID_BASE
    assert own.frontends == (Frontend("169.254.20.10", 53, UDP, sid),)
    assert [(b.address, b.port) for b in own.backends] == [("10.0.1.5", 5353)]  # its family only

    # A snapshot of the lb's services keeps it; one that takes its address
    # (a service's frontend) wins over it.
    lr.services_target.replace_all({3: svc(3, "default/web", "10.96.0.3")})
    assert set(rec.keys()) == {3, sid}
    taken = svc(4, "default/link-local", "169.254.20.10")
    lr.services_target.upsert(4, taken)
    assert set(rec.keys()) == {3, 4}
    assert rec.get(4) == taken
    assert lr.released == {own.backends[0].id}
    lr.services_target.delete(4)
    assert set(rec.keys()) == {3, sid}
    back = rec.get(sid)
    assert back is not None
    # Not the released id, which the maps still hold until it is removed.
    assert back.backends[0].id != own.backends[0].id

    # The policy deleted: nothing of it is left.
    lr.lrps_target.delete(codec.key(ev))
    assert set(rec.keys()) == {3}
    assert lr.released == {own.backends[0].id, back.backends[0].id}
