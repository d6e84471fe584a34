"""The lb service's RPCs against a real etcd and a real lb process: CRUD,
errors (code, field and nothing stored), node ports, Maglev tables."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.lb import LbClient, etcd_dump, lb_with_etcd, rpc_error, service

from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.lb.maglev import DEFAULT_SEED, MaglevBackend, backend_key, lookup_table, parse_seed

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]


@pytest.fixture(scope="module")
def lb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, LbClient]]:
    """One etcd and one lb process for the module (tests use distinct names)."""
    with lb_with_etcd(
        tmp_path_factory.mktemp("lb-api"), "--node-port-range", "30000-30009"
    ) as suite:
        yield suite


def test_create_get_update_list_delete(lb: tuple[EtcdServer, LbClient]) -> None:
    etcd, c = lb
    svc = service(
        "crud/web",
        "10.96.1.10",
        80,
        [("10.1.0.1", 8080), ("10.1.0.2", 8080, 3)],
        algorithm=pb.ALGORITHM_MAGLEV,
    )
    created = c.upsert(svc)
    assert created.created
    s = created.service
    assert s.id > 0
    assert s.rev_nat_id > 0
    assert s.namespace == "crud"
    assert s.source == "api"
    assert s.maglev_table_size == 16381
    assert s.revision > 0
    assert [(b.address, b.weight, b.state) for b in s.backends] == [
        ("10.1.0.1", 1, pb.BACKEND_STATE_ACTIVE),
        ("10.1.0.2", 3, pb.BACKEND_STATE_ACTIVE),
    ]
    ids = {b.address: b.id for b in s.backends}
    assert len(set(ids.values())) == 2
    assert 0 not in ids.values()

    assert c.get("crud/web") == s
    assert c.stub.GetService(pb.GetServiceRequest(id=s.id)) == s
    assert c.stub.GetService(pb.GetServiceRequest(frontend=svc.frontend)) == s

    # The same again changes nothing, not even the revision.
    again = c.upsert(svc)
    assert not again.created
    assert again.service == s

    # A service read back can be changed and upserted: output fields ignored.
    changed = pb.Service()
    changed.CopyFrom(s)
    del changed.backends[0]
    changed.backends.add(address="10.1.0.3", port=8080)
    changed.session_affinity.type = pb.SessionAffinity.TYPE_CLIENT_IP
    updated = c.upsert(changed).service
    assert updated.id == s.id
    assert updated.rev_nat_id == s.rev_nat_id
    assert updated.revision > s.revision
    new_ids = {b.address: b.id for b in updated.backends}
    assert new_ids["10.1.0.2"] == ids["10.1.0.2"]
    assert new_ids["10.1.0.3"] not in ids.values()
    assert updated.session_affinity.timeout.seconds == 10800

    c.upsert(service("crud/db", "10.96.1.11", 5432, [("10.1.1.1", 5432)]))
    c.upsert(service("other/db", "10.96.1.12", 5432))
    listed = c.list("crud")
    assert [x.name for x in listed.services] == ["crud/db", "crud/web"]
    assert listed.revision >= updated.revision
    assert "other/db" in [x.name for x in c.list().services]

    before = etcd_dump(etcd)
    assert c.delete("crud/web")
    assert not c.delete("crud/web")
    err = rpc_error(c.get, "crud/web")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    after = etcd_dump(etcd)
    gone = set(before) - set(after)
    # Its record, name, frontend, rev-NAT id and backend block are all freed.
    assert {k.split("/")[3] for k in gone} == {"services", "names", "frontends", "ids"}
    assert all(b"crud/web" not in v for v in after.values())
    assert set(after) <= set(before)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("bad frontend address", {"address": "10.96.300.1"}, "service.frontend.address"),
    ("bad frontend port", {"port": 0}, "service.frontend.port"),
    ("bad backend address", {"backends": [("10.2.0.x", 80)]}, "service.backends[0].address"),
    ("bad backend port", {"backends": [("10.2.0.1", 65536)]}, "service.backends[0].port"),
    ("weight out of range", {"backends": [("10.2.0.1", 80, 101)]}, "service.backends[0].weight"),
    ("unknown algorithm", {"algorithm": 5}, "service.algorithm"),
    ("M not a supported prime", {"maglev_table_size": 16383}, "service.maglev_table_size"),
    (
        "NodePort outside the range",
        {"type": pb.SERVICE_TYPE_NODE_PORT, "node_port": 30010},
        "service.node_port",
    ),
    ("duplicate frontend", {"address": "10.96.2.1"}, "service.frontend"),
    (
        "duplicate node port",
        {"type": pb.SERVICE_TYPE_NODE_PORT, "node_port": 30001},
        "service.node_port",
    ),
    ("bad external IP", {"external_ips": ["203.0.113.x"]}, "service.external_ips[0]"),
    ("external IP of the other family", {"external_ips": ["fd00::1"]}, "service.external_ips[0]"),
    (
        "duplicate external IP",
        {"external_ips": ["203.0.113.1", "203.0.113.1"]},
        "service.external_ips[1]",
    ),
    ("external IP multicast", {"external_ips": ["224.0.0.1"]}, "service.external_ips[0]"),
    (
        "external IP another service's frontend",
        {"external_ips": ["203.0.113.5", "10.96.2.1"]},
        "service.external_ips[1]",
    ),
    (
        "external IP another service's external IP",
        {"external_ips": ["203.0.113.9"]},
        "service.external_ips[0]",
    ),
    ("frontend another service's external IP", {"address": "203.0.113.9"}, "service.frontend"),
    ("unknown traffic policy", {"external_traffic_policy": 7}, "service.external_traffic_policy"),
    (
        "health check port without Local",
        {"health_check_node_port": 30005},
        "service.health_check_node_port",
    ),
    (
        "health check port outside the range",
        {
            "type": pb.SERVICE_TYPE_NODE_PORT,
            "external_traffic_policy": pb.TRAFFIC_POLICY_LOCAL,
            "health_check_node_port": 30010,
        },
        "service.health_check_node_port",
    ),
    (
        "Local on a ClusterIP service without external IPs",
        {"external_traffic_policy": pb.TRAFFIC_POLICY_LOCAL},
        "service.external_traffic_policy",
    ),
]


@pytest.mark.parametrize(("what", "change", "field"), BAD, ids=[b[0] for b in BAD])
def test_rejections_name_the_field_and_store_nothing(
    lb: tuple[EtcdServer, LbClient], what: str, change: dict[str, Any], field: str
) -> None:
    etcd, c = lb
    c.upsert(
        service(
            "errors/taken",
            "10.96.2.1",
            80,
            [("10.2.0.9", 80)],
            type=pb.SERVICE_TYPE_NODE_PORT,
            node_port=30001,
            external_ips=["203.0.113.9"],
        )
    )
    c.upsert(service("errors/mine", "10.96.2.2", 80, [("10.2.0.8", 80)]))
    before = etcd_dump(etcd)
    # As a create, and as an update of an existing service.
    for name, own_address in (("errors/new", "10.96.2.3"), ("errors/mine", "10.96.2.2")):
        kw: dict[str, Any] = {"port": 80, "backends": [("10.2.0.1", 80)]}
        kw.update(change)
        address = kw.pop("address", own_address)
        err = rpc_error(c.upsert, service(name, address, **kw))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.details())
        assert err.details().startswith(f"{field}: "), err.details()
        if "another service" in what:
            assert "'errors/taken'" in err.details(), err.details()
        assert etcd_dump(etcd) == before
    assert rpc_error(c.get, "errors/new").code() == grpc.StatusCode.NOT_FOUND


def test_other_request_errors(lb: tuple[EtcdServer, LbClient]) -> None:
    _, c = lb
    err = rpc_error(c.stub.GetService, pb.GetServiceRequest())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("by: ")
    err = rpc_error(c.stub.GetService, pb.GetServiceRequest(frontend=pb.Frontend(address="x")))
    assert err.details().startswith("frontend.address: ")
    err = rpc_error(c.stub.GetService, pb.GetServiceRequest(id=65000))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = rpc_error(c.upsert, pb.Service())
    assert err.details().startswith("service.name: ")
    err = rpc_error(c.stub.UpsertService, pb.UpsertServiceRequest())
    assert err.details().startswith("service: ")
    err = rpc_error(c.stub.DeleteService, pb.DeleteServiceRequest())
    assert err.details().startswith("name: ")


def test_node_ports_allocated_from_the_range_and_kept(lb: tuple[EtcdServer, LbClient]) -> None:
    _, c = lb
    a = c.upsert(service("np/a", "10.96.3.1", 80, type=pb.SERVICE_TYPE_NODE_PORT)).service
    b = c.upsert(service("np/b", "10.96.3.2", 80, type=pb.SERVICE_TYPE_NODE_PORT)).service
    assert 30000 <= a.node_port <= 30009
    assert 30000 <= b.node_port <= 30009
    assert a.node_port != b.node_port
    # Kept on update when none is asked for.
    a2 = c.upsert(
        service("np/a", "10.96.3.1", 80, [("10.3.0.1", 80)], type=pb.SERVICE_TYPE_NODE_PORT)
    ).service
    assert a2.node_port == a.node_port
    # The same port on UDP is another port.
    u = c.upsert(
        service(
            "np/u",
            "10.96.3.1",
            80,
            protocol=pb.PROTOCOL_UDP,
            type=pb.SERVICE_TYPE_NODE_PORT,
            node_port=a.node_port,
        )
    ).service
    assert u.node_port == a.node_port
    # Back to ClusterIP frees the port.
    c.upsert(service("np/a", "10.96.3.1", 80))
    taken = c.upsert(
        service("np/c", "10.96.3.3", 80, type=pb.SERVICE_TYPE_NODE_PORT, node_port=a.node_port)
    ).service
    assert taken.node_port == a.node_port
    # The range runs out: RESOURCE_EXHAUSTED, nothing stored.
    made = []
    exhausted = None
    for i in range(20):
        try:
            made.append(
                c.upsert(
                    service(f"np/fill{i}", f"10.96.3.{100 + i}", 80, type=pb.SERVICE_TYPE_NODE_PORT)
                ).service.node_port
            )
        except grpc.RpcError as exc:
            exhausted = exc
            break
    assert exhausted is not None, "the node port range never ran out"
    assert exhausted.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exhausted.details()
    assert len(set(made)) == len(made)
    for i in range(len(made)):
        c.delete(f"np/fill{i}")
    for name in ("np/a", "np/b", "np/c", "np/u"):
        c.delete(name)


def test_maglev_table_rpc(lb: tuple[EtcdServer, LbClient]) -> None:
    _, c = lb
    svc = service(
        "mg/web",
        "10.96.4.1",
        80,
        [("10.4.0.1", 80), ("10.4.0.2", 80, 2), ("10.4.0.3", 80)],
        algorithm=pb.ALGORITHM_MAGLEV,
        maglev_table_size=1021,
    )
    svc.backends[2].state = pb.BACKEND_STATE_TERMINATING
    s = c.upsert(svc).service
    table = c.table("mg/web")
    assert table.service_id == s.id
    assert table.size == 1021
    assert len(table.backend_ids) == 1021
    by_addr = {b.address: b.id for b in s.backends}
    # Terminating backends get no new flows.
    assert set(table.backend_ids) == {by_addr["10.4.0.1"], by_addr["10.4.0.2"]}
    # The same table as computed here from the same input and seed.
    expected = lookup_table(
        [
            MaglevBackend(backend_key(b.address, b.port, "TCP"), b.id, b.weight)
            for b in s.backends
            if b.state == pb.BACKEND_STATE_ACTIVE
        ],
        1021,
        parse_seed(DEFAULT_SEED),
    )
    assert list(table.backend_ids) == expected
    c.upsert(service("mg/random", "10.96.4.2", 80, [("10.4.1.1", 80)]))
    err = rpc_error(c.table, "mg/random")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("name: ")
    assert rpc_error(c.table, "mg/none").code() == grpc.StatusCode.NOT_FOUND


def test_external_ips_and_traffic_policy(lb: tuple[EtcdServer, LbClient]) -> None:
    """Stored in canonical form, returned, freed by an update and by the
    delete; the same address on another port is another frontend."""
    etcd, c = lb
    ext = service(
        "ext/a",
        "fd00:96::1",
        443,
        [("fd00:2::1", 8443)],
        external_ips=["2001:DB8::10", "2001:db8:0::11"],
        external_traffic_policy=pb.TRAFFIC_POLICY_LOCAL,
    )
    ext.health_check_node_port = 30007
    got = c.upsert(ext).service
    assert list(got.external_ips) == ["2001:db8::10", "2001:db8::11"]
    assert got.external_traffic_policy == pb.TRAFFIC_POLICY_LOCAL
    assert got.health_check_node_port == 30007
    assert c.get("ext/a").external_ips == got.external_ips
    # The same again writes nothing.
    again = c.upsert(ext)
    assert not again.created
    assert again.service.revision == got.revision
    keys = {k for k in etcd_dump(etcd) if "/frontends/TCP/2001:db8::" in k}
    assert keys == {
        "flagella/lb/v1/frontends/TCP/2001:db8::10/443",
        "flagella/lb/v1/frontends/TCP/2001:db8::11/443",
    }
    # Another port of the same address is another frontend.
    other = service("ext/b", "fd00:96::2", 80, external_ips=["2001:db8::10"])
    assert list(c.upsert(other).service.external_ips) == ["2001:db8::10"]
    # Taken on 443 until ext/a lets it go.
    taken = service("ext/c", "fd00:96::3", 443, external_ips=["2001:db8::11"])
    err = rpc_error(c.upsert, taken)
    assert err.details() == (
        "service.external_ips[0]: [2001:db8::11]:443/TCP is already served by service 'ext/a'"
    )
    del ext.external_ips[1]
    ext.external_traffic_policy = pb.TRAFFIC_POLICY_CLUSTER
    ext.health_check_node_port = 0
    got = c.upsert(ext).service
    assert list(got.external_ips) == ["2001:db8::10"]
    assert got.external_traffic_policy == pb.TRAFFIC_POLICY_CLUSTER
    assert list(c.upsert(taken).service.external_ips) == ["2001:db8::11"]
    for name in ("ext/a", "ext/b", "ext/c"):
        assert c.delete(name)
    assert not {k for k in etcd_dump(etcd) if "2001:db8::" in k}
