"""Validation of services: every rejection names its field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from google.protobuf.duration_pb2 import Duration

from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.lb.model import (
    Affinity,
    Algorithm,
    BackendState,
    Frontend,
    Protocol,
    ServiceRecord,
    ServiceType,
    Source,
    TrafficPolicy,
)
from flagella.lb.servicer import raw_from_proto, service_to_proto
from flagella.lb.validation import (
    Limits,
    RawBackend,
    RawService,
    build_spec,
    canonical_ip,
    check_ip,
)

LIMITS = Limits(node_port_min=30000, node_port_max=32767, max_backends=8)


def raw(**kw: object) -> RawService:
    base: dict[str, object] = {
        "name": "default/web",
        "frontend_address": "10.96.0.10",
        "frontend_port": 80,
        "backends": [RawBackend("10.0.0.1", 8080), RawBackend("10.0.0.2", 8080)],
    }
    base.update(kw)
    return RawService(**base)  # type: ignore[arg-type]


def rejected(r: RawService) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        build_spec(r, LIMITS)
    return info.value


def test_defaults_and_canonical_form() -> None:
    spec = build_spec(
        raw(
            name="web",
            namespace="default",
            frontend_address="fd00:0::10",
            backends=[RawBackend("fd00::2", 80, weight=5), RawBackend("FD00::1", 80)],
            source_ranges=["fd00::/8", "fd00:1::1/64", "fd00::/8"],
        ),
        LIMITS,
    )
    assert spec.name == "default/web"
    assert spec.namespace == "default"
    assert spec.frontend.address == "fd00::10"
    assert spec.frontend.protocol is Protocol.TCP
    assert spec.type is ServiceType.CLUSTER_IP
    assert spec.algorithm is Algorithm.RANDOM
    assert spec.maglev_table_size == 16381
    assert [(b.address, b.weight, b.state) for b in spec.backends] == [
        ("fd00::1", 1, BackendState.ACTIVE),
        ("fd00::2", 5, BackendState.ACTIVE),
    ]
    assert spec.source_ranges == ("fd00::/8", "fd00:1::/64")
    assert spec.affinity is None


@pytest.mark.parametrize(
    ("kw", "field", "text"),
    [
        ({"name": ""}, "service.name", "required"),
        ({"name": "Bad_Name"}, "service.name", "not a valid service name"),
        ({"name": "a/b/c"}, "service.name", "not a valid"),
        ({"name": "ns/x", "namespace": "other"}, "service.namespace", "differs"),
        ({"frontend_address": ""}, "service.frontend.address", "required"),
        ({"frontend_address": "10.96.0.300"}, "service.frontend.address", "not an IPv4 or IPv6"),
        ({"frontend_address": "0.0.0.0"}, "service.frontend.address", "unspecified"),
        ({"frontend_address": "224.0.0.1"}, "service.frontend.address", "multicast"),
        ({"frontend_port": 0}, "service.frontend.port", "not a port"),
        ({"frontend_port": 70000}, "service.frontend.port", "not a port"),
        (
            {"backends": [RawBackend("10.0.0.1", 1), RawBackend("x", 1)]},
            "service.backends[1].address",
            "not an IPv4",
        ),
        ({"backends": [RawBackend("fd00::1", 80)]}, "service.backends[0].address", "IPv6"),
        ({"backends": [RawBackend("10.0.0.1", 0)]}, "service.backends[0].port", "not a port"),
        (
            {"backends": [RawBackend("10.0.0.1", 80, weight=101)]},
            "service.backends[0].weight",
            "not a weight",
        ),
        (
            {"backends": [RawBackend("10.0.0.1", 80), RawBackend("10.0.0.1", 80)]},
            "service.backends[1]",
            "already backend 0",
        ),
        (
            {"backends": [RawBackend(f"10.0.0.{i}", 80) for i in range(1, 10)]},
            "service.backends",
            "at most 8",
        ),
        (
            {"type": ServiceType.NODE_PORT, "node_port": 29999},
            "service.node_port",
            "outside the node port range 30000-32767",
        ),
        (
            {"type": ServiceType.NODE_PORT, "node_port": 32768},
            "service.node_port",
            "outside",
        ),
        ({"node_port": 30080}, "service.node_port", "only NodePort"),
        ({"maglev_table_size": 16383}, "service.maglev_table_size", "not a supported"),
        (
            {"client_ip_affinity": True, "affinity_timeout": (0, 0)},
            "service.session_affinity.timeout",
            "not a timeout",
        ),
        (
            {"client_ip_affinity": True, "affinity_timeout": (86401, 0)},
            "service.session_affinity.timeout",
            "not a timeout",
        ),
        (
            {"client_ip_affinity": True, "affinity_timeout": (10, 5)},
            "service.session_affinity.timeout",
            "whole seconds",
        ),
        ({"affinity_timeout": (60, 0)}, "service.session_affinity.timeout", "needs ClientIP"),
        ({"source_ranges": ["10.0.0.0/8", "nope"]}, "service.source_ranges[1]", "not a CIDR"),
        ({"source_ranges": ["fd00::/8"]}, "service.source_ranges[0]", "IPv6"),
    ],
)
def test_rejections_name_the_field(kw: dict[str, object], field: str, text: str) -> None:
    err = rejected(raw(**kw))
    assert err.field == field
    assert text in err.message
    assert err.details.startswith(f"{field}: ")


def test_affinity_defaults_to_kubernetes_timeout() -> None:
    spec = build_spec(raw(client_ip_affinity=True), LIMITS)
    assert spec.affinity == Affinity(10800)
    spec = build_spec(raw(client_ip_affinity=True, affinity_timeout=(60, 0)), LIMITS)
    assert spec.affinity == Affinity(60)


def _proto(**kw: object) -> pb.Service:
    svc = pb.Service(
        name="default/web",
        frontend=pb.Frontend(address="10.96.0.10", port=80, protocol=pb.PROTOCOL_UDP),
        backends=[pb.Backend(address="10.0.0.1", port=53, state=pb.BACKEND_STATE_TERMINATING)],
    )
    for k, v in kw.items():
        setattr(svc, k, v)
    return svc


def test_proto_enums_map_and_unknown_values_are_rejected() -> None:
    r = raw_from_proto(_proto(algorithm=pb.ALGORITHM_MAGLEV, type=pb.SERVICE_TYPE_NODE_PORT))
    assert r.protocol is Protocol.UDP
    assert r.algorithm is Algorithm.MAGLEV
    assert r.type is ServiceType.NODE_PORT
    assert r.backends[0].state is BackendState.TERMINATING
    for kw, field in (
        ({"algorithm": 7}, "service.algorithm"),
        ({"type": 9}, "service.type"),
    ):
        with pytest.raises(InvalidArgument) as info:
            raw_from_proto(_proto(**kw))
        assert info.value.field == field
    svc = _proto()
    svc.frontend.protocol = 132  # type: ignore[assignment]  # SCTP: not supported
    with pytest.raises(InvalidArgument) as info:
        raw_from_proto(svc)
    assert info.value.field == "service.frontend.protocol"
    svc = _proto()
    svc.backends[0].state = 8  # type: ignore[assignment]
    with pytest.raises(InvalidArgument) as info:
        raw_from_proto(svc)
    assert info.value.field == "service.backends[0].state"


def test_affinity_timeout_from_proto() -> None:
    svc = _proto()
    svc.session_affinity.type = pb.SessionAffinity.TYPE_CLIENT_IP
    svc.session_affinity.timeout.CopyFrom(Duration(seconds=30))
    r = raw_from_proto(svc)
    assert r.client_ip_affinity
    assert r.affinity_timeout == (30, 0)
    assert raw_from_proto(_proto()).affinity_timeout is None


def test_record_round_trips_through_json_and_proto_output_fields_are_ignored() -> None:
    spec = build_spec(raw_from_proto(_proto(algorithm=pb.ALGORITHM_MAGLEV)), LIMITS)
    rec = ServiceRecord(
        name=spec.name,
        namespace=spec.namespace,
        id=7,
        rev_nat_id=9,
        frontend=spec.frontend,
        type=spec.type,
        node_port=0,
        backends=(),
        algorithm=spec.algorithm,
        maglev_table_size=spec.maglev_table_size,
        affinity=Affinity(60),
        source_ranges=("10.0.0.0/8",),
        source=Source.API,
        backend_blocks=(3,),
    )
    assert ServiceRecord.from_json(rec.to_json(), 5) == rec
    out = service_to_proto(rec.with_revision(5))
    assert out.revision == 5
    assert out.session_affinity.timeout.seconds == 60
    # A service read back (ids, revision, source set) upserts as the same spec.
    again = raw_from_proto(out)
    assert again.source is Source.API


@pytest.mark.parametrize(
    "value",
    [
        "1.2.3.4",
        "10.96.0.10",
        "255.255.255.255",
        "240.0.0.1",
        "223.255.255.255",
        "224.0.0.1",
        "239.255.255.255",
        "0.0.0.0",
        "0.0.0.1",
        "01.2.3.4",
        "1.2.3.04",
        "1.2.3",
        "1.2.3.4.5",
        "1.2.3.256",
        " 1.2.3.4",
        "1.2.3.4 ",
        "1.2.3.4\x00",
        "0x1.2.3.4",
        "",
        "::",
        "::1",
        "fe80::1",
        "FE80::0001",
        "ff02::1",
        "::ffff:1.2.3.4",
        "2001:db8::1.2.3.4",
    ],
)
def test_canonical_ip_is_check_ip_faster(value: str) -> None:
    """The inet_pton fast path answers as ipaddress does: the same
    canonical text, family and value, or the same refusal."""

    def outcome(fn: Callable[[], object]) -> object:
        try:
            return fn()
        except InvalidArgument as exc:
            return ("refused", exc.field, exc.message)

    def slow() -> object:
        ip = check_ip(value, "f")
        return (str(ip), ip.version, int(ip))

    assert outcome(lambda: canonical_ip(value, "f")) == outcome(slow)


def test_external_ips_and_traffic_policy() -> None:
    """externalIPs canonical in the caller's order; Local only where there is
    external traffic; both survive the record's JSON and the proto."""
    spec = build_spec(
        raw(
            frontend_address="fd00:96::10",
            backends=[RawBackend("fd00::1", 8080)],
            external_ips=["2001:DB8::1", "2001:db8::0:0"],
            external_traffic_policy=TrafficPolicy.LOCAL,
        ),
        LIMITS,
    )
    assert spec.external_ips == ("2001:db8::1", "2001:db8::")
    assert [fe.address for fe in spec.external_frontends()] == ["2001:db8::1", "2001:db8::"]
    assert {fe.port for fe in spec.external_frontends()} == {80}
    # Local needs a node port, a LoadBalancer request or external IPs.
    assert build_spec(
        raw(type=ServiceType.NODE_PORT, external_traffic_policy=TrafficPolicy.LOCAL), LIMITS
    )
    assert build_spec(raw(load_balancer=True, external_traffic_policy=TrafficPolicy.LOCAL), LIMITS)
    err = rejected(raw(external_traffic_policy=TrafficPolicy.LOCAL))
    assert err.field == "service.external_traffic_policy"
    for ips, field in (
        (["10.0.0.300"], "service.external_ips[0]"),
        (["192.0.2.1", "fd00::1"], "service.external_ips[1]"),
        (["192.0.2.1", "192.0.2.1"], "service.external_ips[1]"),
        (["10.96.0.10"], "service.external_ips[0]"),  # the frontend itself
        (["0.0.0.0"], "service.external_ips[0]"),
        (["192.0.2.1"] * 65, "service.external_ips"),
    ):
        assert rejected(raw(external_ips=ips)).field == field, ips

    rec = ServiceRecord(
        name="web",
        namespace="",
        id=1,
        rev_nat_id=1,
        frontend=Frontend("10.96.0.10", 80, Protocol.TCP),
        type=ServiceType.CLUSTER_IP,
        node_port=0,
        backends=(),
        algorithm=Algorithm.RANDOM,
        maglev_table_size=16381,
        affinity=None,
        source_ranges=(),
        source=Source.API,
        external_traffic_policy=TrafficPolicy.LOCAL,
        external_ips=("192.0.2.9",),
    )
    assert ServiceRecord.from_json(rec.to_json()) == rec
    out = service_to_proto(rec)
    assert out.external_traffic_policy == pb.TRAFFIC_POLICY_LOCAL
    assert list(out.external_ips) == ["192.0.2.9"]
    back = raw_from_proto(out)
    assert back.external_traffic_policy is TrafficPolicy.LOCAL
    assert list(back.external_ips) == ["192.0.2.9"]
    # A record without them stores neither key (older records read the same).
    plain = ServiceRecord.from_json(rec.to_json())
    assert (
        b"external"
        not in replace(
            plain, external_ips=(), external_traffic_policy=TrafficPolicy.CLUSTER
        ).to_json()
    )
    with pytest.raises(InvalidArgument) as info:
        raw_from_proto(pb.Service(name="web", external_traffic_policy=9))  # type: ignore[arg-type]
    assert info.value.field == "service.external_traffic_policy"
