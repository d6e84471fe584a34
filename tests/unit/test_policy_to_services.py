"""toServices (CiliumNetworkPolicy egress): a service by name or by label
selector stands for its backends' addresses, as prefix entries of the
resolved policy that follow the services as they change; a service with no
backends (or none at all) selects nothing, never any peer; every error
names its field. Also lb's service labels, which selectors match."""

from __future__ import annotations

import ipaddress

import pytest
from harness.kube_api import k8s_service
from policy_world import World

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.lb.k8s import translate
from flagella.lb.validation import Limits, RawService, build_spec
from flagella.policy.convert import rule_from_pb, rule_pb
from flagella.policy.identities import WORLD
from flagella.policy.lbservices import ServiceCodec
from flagella.policy.prefixes import ALL_PORTS
from flagella.policy.rules import (
    Direction,
    Protocol,
    SelectorSpec,
    ServiceInfo,
    ServicePeer,
    parse_document,
    rule_from_json,
    rule_to_json,
    service_name,
)
from flagella.policy.state import PolicyState

TCP = Protocol.TCP


def doc(to_services: str, *, kind: str = "CiliumNetworkPolicy", extra: str = "") -> str:
    ns = "" if kind == "CiliumClusterwideNetworkPolicy" else ", namespace: shop"
    return f"""
apiVersion: cilium.io/v2
kind: {kind}
metadata: {{name: to-db{ns}}}
spec:
  endpointSelector: {{matchLabels: {{app: web}}}}
  egress:
  - toServices: {to_services}
{extra}
"""


BY_NAME = doc("[{k8sService: {serviceName: db}}]")
BY_NAME_443 = doc(
    "[{k8sService: {serviceName: db}}]",
    extra='    toPorts: [{ports: [{port: "5432", protocol: TCP}]}]',
)
BY_LABEL = doc("[{k8sServiceSelector: {selector: {matchLabels: {tier: data}}}}]")


def svc(key: str, *addresses: str, **labels: str) -> ServiceInfo:
    namespace = key.partition("/")[0] if "/" in key else ""
    return ServiceInfo(
        namespace=namespace,
        name=service_name(key),
        labels=tuple(sorted(labels.items())),
        addresses=tuple(ipaddress.ip_network(a) for a in addresses),
    )


class Services:
    """The lb services as the policy state reads them."""

    def __init__(self) -> None:
        self.by_key: dict[str, ServiceInfo] = {}

    def __call__(self) -> tuple[ServiceInfo, ...]:
        return tuple(self.by_key.values())


def world(services: Services) -> World:
    w = World()
    w.state = PolicyState(services=services)
    w.pod("web", "shop", app="web")
    return w


def prefixes(w: World, name: str = "web") -> dict[str, tuple]:
    return {
        str(e.prefix): e.ports
        for e in w.content(w.names[name]).prefix_entries
        if e.direction is Direction.EGRESS
    }


def test_backends_become_prefix_entries_and_follow_the_service() -> None:
    services = Services()
    services.by_key["shop/db:5432"] = svc("shop/db:5432", "10.0.1.5/32", "10.0.2.7/32")
    services.by_key["shop/db:5432:ipv6"] = svc("shop/db:5432:ipv6", "fd00::5/128")
    services.by_key["shop/cache:6379"] = svc("shop/cache:6379", "10.0.3.3/32")
    services.by_key["other/db:5432"] = svc("other/db:5432", "10.0.9.9/32")
    w = world(services)
    w.rules(BY_NAME)
    content = w.content(w.names["web"])
    assert content.egress_enforced
    assert content.service_rules
    # Every port of each backend of shop/db (both families), and no other.
    assert prefixes(w) == {
        "10.0.1.5/32": (ALL_PORTS,),
        "10.0.2.7/32": (ALL_PORTS,),
        "fd00::5/128": (ALL_PORTS,),
    }
    # A backend replaced: the old address goes, the new one comes, without
    # any change to the rule.
    services.by_key["shop/db:5432"] = svc("shop/db:5432", "10.0.1.5/32", "10.0.4.4/32")
    change = w.state.services_changed()
    assert w.names["web"] in change.dirty
    assert set(prefixes(w)) == {"10.0.1.5/32", "10.0.4.4/32", "fd00::5/128"}
    # The service deleted: nothing, and never any peer.
    del services.by_key["shop/db:5432"], services.by_key["shop/db:5432:ipv6"]
    w.state.services_changed()
    assert prefixes(w) == {}
    assert not w.allowed(w.names["web"], WORLD, 5432, TCP)
    # Created again later: followed.
    services.by_key["shop/db:5432"] = svc("shop/db:5432", "10.0.5.5/32")
    w.state.services_changed()
    assert set(prefixes(w)) == {"10.0.5.5/32"}


def test_unchanged_backends_dirty_nothing() -> None:
    services = Services()
    services.by_key["shop/db:5432"] = svc("shop/db:5432", "10.0.1.5/32")
    w = world(services)
    w.rules(BY_NAME)
    services.by_key["shop/cache:6379"] = svc("shop/cache:6379", "10.0.3.3/32")
    assert not w.state.services_changed().dirty


def test_to_ports_restrict_and_no_backends_never_means_any_peer() -> None:
    services = Services()
    w = world(services)
    w.rules(BY_NAME_443)
    web = w.names["web"]
    # No such service yet: selects nothing, even with toPorts.
    assert w.content(web).egress_enforced
    assert prefixes(w) == {}
    assert not w.allowed(web, WORLD, 5432, TCP)
    assert all(
        e.identity != 0 or e.direction is not Direction.EGRESS for e in w.content(web).entries
    )
    services.by_key["shop/db:5432"] = svc("shop/db:5432", "10.0.1.5/32")
    w.state.services_changed()
    assert prefixes(w) == {"10.0.1.5/32": ((5432, 0, TCP),)}


def test_selector_by_labels_and_namespaces() -> None:
    services = Services()
    services.by_key["shop/db:5432"] = svc("shop/db:5432", "10.0.1.5/32", tier="data")
    services.by_key["shop/web:80"] = svc("shop/web:80", "10.0.1.6/32", tier="front")
    services.by_key["other/db:5432"] = svc("other/db:5432", "10.0.9.9/32", tier="data")
    w = world(services)
    # Namespaced rule, no namespace given: the rule's.
    w.rules(BY_LABEL)
    assert set(prefixes(w)) == {"10.0.1.5/32"}
    # A namespace given: that one.
    w.rules(
        doc(
            "[{k8sServiceSelector: {namespace: other, selector: "
            "{matchExpressions: [{key: tier, operator: In, values: [data]}]}}}]"
        )
    )
    assert set(prefixes(w)) == {"10.0.9.9/32"}
    # Cluster-wide, no namespace: any namespace (as Cilium).
    w.delete_rule("shop/to-db")
    w.rules(
        doc(
            "[{k8sServiceSelector: {selector: {matchLabels: {tier: data}}}}]",
            kind="CiliumClusterwideNetworkPolicy",
        )
    )
    assert set(prefixes(w)) == {"10.0.1.5/32", "10.0.9.9/32"}
    # Labels change: followed.
    services.by_key["shop/web:80"] = svc("shop/web:80", "10.0.1.6/32", tier="data")
    w.state.services_changed()
    assert set(prefixes(w)) == {"10.0.1.5/32", "10.0.1.6/32", "10.0.9.9/32"}


def test_round_trips_through_json_and_proto() -> None:
    for text in (BY_NAME_443, BY_LABEL):
        (rule,) = parse_document(text)
        assert rule_from_json(rule_to_json(rule)).content() == rule.content()
        assert rule_from_pb(rule_pb(rule), "rule") == rule.content()
    (rule,) = parse_document(BY_LABEL)
    assert rule.egress[0].services == (
        ServicePeer(selector=SelectorSpec(match_labels=(("tier", "data"),))),
    )
    # An empty selector (every service) stays a selector.
    (rule,) = parse_document(doc("[{k8sServiceSelector: {selector: {}}}]"))
    assert rule_from_json(rule_to_json(rule)).egress[0].services[0].selector == SelectorSpec()
    assert rule_from_pb(rule_pb(rule), "r").egress[0].services[0].selector == SelectorSpec()


@pytest.mark.parametrize(
    ("services", "field"),
    [
        ("[{}]", "spec.egress[0].toServices[0]"),
        (
            "[{k8sService: {serviceName: a}, k8sServiceSelector: {selector: {}}}]",
            "spec.egress[0].toServices[0]",
        ),
        (
            "[{k8sService: {serviceName: ''}}]",
            "spec.egress[0].toServices[0].k8sService.serviceName",
        ),
        (
            "[{k8sService: {namespace: shop}}]",
            "spec.egress[0].toServices[0].k8sService.serviceName",
        ),
        (
            "[{k8sService: {serviceName: Bad_Name}}]",
            "spec.egress[0].toServices[0].k8sService.serviceName",
        ),
        (
            "[{k8sService: {serviceName: db, namespace: NOPE}}]",
            "spec.egress[0].toServices[0].k8sService.namespace",
        ),
        ("[{k8sServiceSelector: {}}]", "spec.egress[0].toServices[0].k8sServiceSelector.selector"),
        (
            "[{k8sServiceSelector: {selector: {matchExpressions: [{key: a, operator: Near}]}}}]",
            "spec.egress[0].toServices[0].k8sServiceSelector.selector.matchExpressions[0].operator",
        ),
        (
            "[{k8sServiceSelector: {selector: {matchLabels: {'reserved:host': ''}}}}]",
            "spec.egress[0].toServices[0].k8sServiceSelector.selector.matchLabels[reserved:host]",
        ),
        (
            "[{k8sService: {serviceName: db, port: 80}}]",
            "spec.egress[0].toServices[0].k8sService.port",
        ),
    ],
)
def test_document_errors_name_the_field(services: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_document(doc(services))
    assert info.value.field == field


def test_deny_and_ingress_refuse_to_services() -> None:
    deny = BY_NAME.replace("  egress:", "  egressDeny:")
    with pytest.raises(InvalidArgument) as info:
        parse_document(deny)
    assert info.value.field == "spec.egressDeny[0].toServices"
    assert "cannot deny" in info.value.details
    ingress = BY_NAME.replace("  egress:", "  ingress:")
    with pytest.raises(InvalidArgument) as info:
        parse_document(ingress)
    assert info.value.field == "spec.ingress[0].toServices"


def _pb_rule(**peers: list[pb.PeerRule]) -> pb.Rule:
    return pb.Rule(name="r", namespace="shop", endpoint_selector=pb.EndpointSelector(), **peers)


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        (
            _pb_rule(egress=[pb.PeerRule(services=[pb.ServiceSelector()])]),
            "rule.egress[0].services[0]",
        ),
        (
            _pb_rule(
                egress=[
                    pb.PeerRule(
                        services=[pb.ServiceSelector(name="db", selector=pb.EndpointSelector())]
                    )
                ]
            ),
            "rule.egress[0].services[0]",
        ),
        (
            _pb_rule(
                egress=[
                    pb.PeerRule(services=[pb.ServiceSelector(name="db", namespace="Not Valid")])
                ]
            ),
            "rule.egress[0].services[0].namespace",
        ),
        (
            _pb_rule(egress_deny=[pb.PeerRule(services=[pb.ServiceSelector(name="db")])]),
            "rule.egress_deny[0].services",
        ),
        (
            _pb_rule(ingress=[pb.PeerRule(services=[pb.ServiceSelector(name="db")])]),
            "rule.ingress[0].services",
        ),
    ],
)
def test_proto_errors_name_the_field(rule: pb.Rule, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        rule_from_pb(rule, "rule")
    assert info.value.field == field


def test_service_names_and_the_stream_codec() -> None:
    assert service_name("shop/web:http") == "web"
    assert service_name("shop/web:80:ipv6") == "web"
    assert service_name("shop/web") == "web"
    assert service_name("web") == "web"
    event = lb_pb2.ServiceEvent(
        kind=lb_pb2.ServiceEvent.KIND_UPSERT,
        service=lb_pb2.Service(
            name="shop/db:5432",
            namespace="shop",
            labels={"tier": "data"},
            backends=[
                lb_pb2.Backend(address="10.0.1.5", port=5432),
                lb_pb2.Backend(address="fd00::5", port=5432),
                lb_pb2.Backend(address="10.0.1.5", port=5433),
            ],
        ),
    )
    info = ServiceCodec().decode(event)
    assert ServiceCodec().key(event) == "shop/db:5432"
    assert info == svc("shop/db:5432", "10.0.1.5/32", "fd00::5/128", tier="data")


LIMITS = Limits(node_port_min=30000, node_port_max=32767, max_backends=8)


def test_lb_services_carry_kubernetes_labels() -> None:
    k8s = k8s_service("shop", "db", "10.96.0.20", [{"name": "pg", "port": 5432, "protocol": "TCP"}])
    k8s["metadata"]["labels"] = {"tier": "data", "app.kubernetes.io/name": "db"}
    (raw,) = translate(k8s, [])
    spec = build_spec(raw, LIMITS)
    assert spec.labels == (("app.kubernetes.io/name", "db"), ("tier", "data"))


@pytest.mark.parametrize(
    ("labels", "field"),
    [
        ({"bad key!": "x"}, "service.labels[bad key!]"),
        ({"tier": "not valid!"}, "service.labels[tier]"),
        ({f"k{i}": "v" for i in range(65)}, "service.labels"),
    ],
)
def test_lb_label_errors_name_the_field(labels: dict[str, str], field: str) -> None:
    raw = RawService(
        name="shop/db", frontend_address="10.96.0.20", frontend_port=5432, labels=labels
    )
    with pytest.raises(InvalidArgument) as info:
        build_spec(raw, LIMITS)
    assert info.value.field == field
