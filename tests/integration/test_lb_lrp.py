"""Local redirect policies on the lb service, against a real etcd and a real
lb process: validation (code, field, nothing stored), storage (create,
replace, get, list, delete), the WatchLrps stream (snapshot, changes,
resume), CiliumLocalRedirectPolicy documents and objects from a stand-in
Kubernetes API server (harness/kube_api.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.kube_api import KubeListWatchServer
from harness.lb import LbClient, etcd_dump, lb_with_etcd, rpc_error, wait_for
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

TCP, UDP = pb.PROTOCOL_TCP, pb.PROTOCOL_UDP


@pytest.fixture(scope="module")
def lb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, LbClient]]:
    with lb_with_etcd(tmp_path_factory.mktemp("lb-lrp")) as suite:
        yield suite


def dns_lrp(name: str = "node-dns", namespace: str = "kube-system") -> pb.LocalRedirectPolicy:
    """Cilium's node-local DNS example: the kube-dns service to the node's
    own node-local-dns pod, both ports by name."""
    p = pb.LocalRedirectPolicy(name=name, namespace=namespace)
    sm = p.redirect_frontend.service_matcher
    sm.service_name = "kube-dns"
    sm.to_ports.add(name="dns", port=53, protocol=UDP)
    sm.to_ports.add(name="dns-tcp", port=53, protocol=TCP)
    p.redirect_backend.local_endpoint_selector.match_labels["k8s-app"] = "node-local-dns"
    p.redirect_backend.to_ports.add(name="dns", port=53, protocol=UDP)
    p.redirect_backend.to_ports.add(name="dns-tcp", port=53, protocol=TCP)
    return p


def address_lrp(name: str = "metadata", ip: str = "169.254.169.254") -> pb.LocalRedirectPolicy:
    p = pb.LocalRedirectPolicy(name=name, namespace="default")
    p.redirect_frontend.address_matcher.ip = ip
    p.redirect_frontend.address_matcher.to_ports.add(port=80, protocol=TCP)
    sel = p.redirect_backend.local_endpoint_selector
    sel.match_expressions.add(key="app", operator="In", values=["proxy", "proxy-v2"])
    p.redirect_backend.to_ports.add(port=8080, protocol=TCP)
    return p


def _bad(edit: object) -> pb.LocalRedirectPolicy:
    p = address_lrp()
    edit(p)  # type: ignore[operator]
    return p


def _both_ports_unnamed(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_frontend.address_matcher.to_ports.add(port=81, protocol=TCP)


def _no_matcher(p: pb.LocalRedirectPolicy) -> None:
    p.ClearField("redirect_frontend")


def _service_other_ns(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_frontend.service_matcher.service_name = "web"
    p.redirect_frontend.service_matcher.namespace = "other"


def _protocol_mismatch(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_backend.to_ports[0].protocol = UDP


def _unmatched_name(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_frontend.address_matcher.to_ports[0].name = "http"
    p.redirect_backend.to_ports.add(name="admin", port=9090, protocol=TCP)
    p.redirect_backend.to_ports[0].name = "web"


def _empty_selector(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_backend.local_endpoint_selector.ClearField("match_expressions")


def _bad_operator(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_backend.local_endpoint_selector.match_expressions[0].operator = "Near"


def _exists_with_values(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_backend.local_endpoint_selector.match_expressions[0].operator = "Exists"


def _bad_label(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_backend.local_endpoint_selector.match_labels["bad key!"] = "x"


def _no_backend_ports(p: pb.LocalRedirectPolicy) -> None:
    p.redirect_backend.ClearField("to_ports")


def _skip_from_backend(p: pb.LocalRedirectPolicy) -> None:
    p.skip_redirect_from_backend = True


def _duplicate_port(p: pb.LocalRedirectPolicy) -> None:
    fe = p.redirect_frontend.address_matcher.to_ports
    fe[0].name = "a"
    fe.add(name="b", port=80, protocol=TCP)


def _set(field: str, value: object) -> object:
    def edit(p: pb.LocalRedirectPolicy) -> None:
        msg: object = p
        *path, last = field.split(".")
        for part in path:
            msg = getattr(msg, part)
        setattr(msg, last, value)

    return edit


BAD = [
    (_set("name", ""), "lrp.name"),
    (_set("name", "a/b"), "lrp.name"),
    (_set("namespace", ""), "lrp.namespace"),
    (_set("namespace", "Bad_NS"), "lrp.namespace"),
    (_no_matcher, "lrp.redirect_frontend"),
    (_set("redirect_frontend.address_matcher.ip", "not-an-ip"), "lrp.redirect_frontend.address_matcher.ip"),
    (_set("redirect_frontend.address_matcher.ip", "0.0.0.0"), "lrp.redirect_frontend.address_matcher.ip"),
    (_set("redirect_frontend.address_matcher.ip", "::ffff:10.0.0.1"), "lrp.redirect_frontend.address_matcher.ip"),
    (lambda p: p.redirect_frontend.address_matcher.ClearField("to_ports"), "lrp.redirect_frontend.address_matcher.to_ports"),
    (lambda p: setattr(p.redirect_frontend.address_matcher.to_ports[0], "port", 70000), "lrp.redirect_frontend.address_matcher.to_ports[0].port"),
    (lambda p: setattr(p.redirect_frontend.address_matcher.to_ports[0], "protocol", 99), "lrp.redirect_frontend.address_matcher.to_ports[0].protocol"),
    (lambda p: setattr(p.redirect_frontend.address_matcher.to_ports[0], "name", "Not A Name"), "lrp.redirect_frontend.address_matcher.to_ports[0].name"),
    (_both_ports_unnamed, "lrp.redirect_frontend.address_matcher.to_ports[0].name"),
    (_duplicate_port, "lrp.redirect_frontend.address_matcher.to_ports[1].port"),
    (_service_other_ns, "lrp.redirect_frontend.service_matcher.namespace"),
    (_set("redirect_frontend.service_matcher.service_name", ""), "lrp.redirect_frontend.service_matcher.service_name"),
    (_protocol_mismatch, "lrp.redirect_backend.to_ports[0].protocol"),
    (_unmatched_name, "lrp.redirect_frontend.address_matcher.to_ports[0].name"),
    (lambda p: p.ClearField("redirect_backend"), "lrp.redirect_backend"),
    (lambda p: p.redirect_backend.ClearField("local_endpoint_selector"), "lrp.redirect_backend.local_endpoint_selector"),
    (_empty_selector, "lrp.redirect_backend.local_endpoint_selector"),
    (_bad_operator, "lrp.redirect_backend.local_endpoint_selector.match_expressions[0].operator"),
    (_exists_with_values, "lrp.redirect_backend.local_endpoint_selector.match_expressions[0].values"),
    (_bad_label, "lrp.redirect_backend.local_endpoint_selector.match_labels[bad key!]"),
    (_no_backend_ports, "lrp.redirect_backend.to_ports"),
    (_skip_from_backend, "lrp.skip_redirect_from_backend"),
]  # fmt: skip


def test_invalid_policies_name_the_field_and_store_nothing(
    lb: tuple[EtcdServer, LbClient],
) -> None:
    etcd, c = lb
    before = etcd_dump(etcd)
    for edit, field in BAD:
        err = rpc_error(c.stub.CreateLrp, pb.CreateLrpRequest(lrp=_bad(edit)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
        assert (err.details() or "").startswith(f"{field}: "), (field, err.details())
    err = rpc_error(c.stub.CreateLrp, pb.CreateLrpRequest())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("lrp: ")
    err = rpc_error(c.stub.GetLrp, pb.GetLrpRequest(namespace="default", name="no/such"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert etcd_dump(etcd) == before


def test_create_replace_get_list_delete_and_watch(lb: tuple[EtcdServer, LbClient]) -> None:
    etcd, c = lb
    stream = c.stub.WatchLrps(pb.WatchLrpsRequest(), timeout=60)
    first = next(stream)
    assert first.kind == pb.LrpEvent.KIND_RESET
    assert next(stream).kind == pb.LrpEvent.KIND_SYNCED

    # A serviceMatcher naming a service that does not exist is accepted
    # (it takes effect when the service appears, as Cilium's).
    made = c.stub.CreateLrp(pb.CreateLrpRequest(lrp=dns_lrp()))
    assert made.created
    assert made.lrp.revision > 0
    assert made.lrp.redirect_frontend.service_matcher.namespace == "kube-system"
    ev = next(stream)
    assert ev.kind == pb.LrpEvent.KIND_UPSERT
    assert ev.lrp == made.lrp
    assert ev.revision == made.lrp.revision

    # The same again writes nothing; a change replaces it.
    again = c.stub.CreateLrp(pb.CreateLrpRequest(lrp=dns_lrp()))
    assert not again.created
    assert again.lrp == made.lrp
    meta = c.stub.CreateLrp(pb.CreateLrpRequest(lrp=address_lrp()))
    assert meta.created
    assert next(stream).lrp == meta.lrp
    changed = address_lrp()
    changed.redirect_backend.to_ports[0].port = 8081
    replaced = c.stub.CreateLrp(pb.CreateLrpRequest(lrp=changed))
    assert not replaced.created
    assert replaced.lrp.revision > meta.lrp.revision
    assert replaced.lrp.redirect_backend.to_ports[0].port == 8081
    assert next(stream).lrp == replaced.lrp
    stored = etcd_dump(etcd)
    assert {k for k in stored if "/lrps/" in k} == {
        "flagella/lb/v1/lrps/default/metadata",
        "flagella/lb/v1/lrps/kube-system/node-dns",
    }

    got = c.stub.GetLrp(pb.GetLrpRequest(namespace="default", name="metadata"))
    assert list(got.lrps) == [replaced.lrp]
    listed = c.stub.GetLrp(pb.GetLrpRequest())
    assert [f"{p.namespace}/{p.name}" for p in listed.lrps] == [
        "default/metadata",
        "kube-system/node-dns",
    ]
    assert listed.revision >= replaced.lrp.revision
    in_ns = c.stub.GetLrp(pb.GetLrpRequest(namespace="kube-system"))
    assert [p.name for p in in_ns.lrps] == ["node-dns"]
    err = rpc_error(c.stub.GetLrp, pb.GetLrpRequest(namespace="default", name="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND

    assert c.stub.DeleteLrp(pb.DeleteLrpRequest(namespace="default", name="metadata")).deleted
    assert not c.stub.DeleteLrp(pb.DeleteLrpRequest(namespace="default", name="metadata")).deleted
    ev = next(stream)
    assert ev.kind == pb.LrpEvent.KIND_DELETE
    assert (ev.lrp.namespace, ev.lrp.name) == ("default", "metadata")
    stream.cancel()

    # A resumed stream: SYNCED at its revision, then only what came after.
    resumed = c.stub.WatchLrps(
        pb.WatchLrpsRequest(since_revision=replaced.lrp.revision), timeout=60
    )
    assert next(resumed).kind == pb.LrpEvent.KIND_SYNCED
    ev = next(resumed)
    assert ev.kind == pb.LrpEvent.KIND_DELETE
    assert ev.lrp.name == "metadata"
    resumed.cancel()


def cilium_lrp(name: str, ip: str) -> dict[str, Any]:
    """A CiliumLocalRedirectPolicy object as Kubernetes serves it (ports as
    strings, as Cilium's schema has them)."""
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumLocalRedirectPolicy",
        "metadata": {"namespace": "shop", "name": name},
        "spec": {
            "redirectFrontend": {
                "addressMatcher": {"ip": ip, "toPorts": [{"port": "80", "protocol": "TCP"}]}
            },
            "redirectBackend": {
                "localEndpointSelector": {"matchLabels": {"app": "proxy"}},
                "toPorts": [{"port": "8080", "protocol": "TCP"}],
            },
        },
    }


def lrps_of(c: LbClient) -> dict[str, tuple[str, str]]:
    """namespace/name: (address, source) of every policy."""
    return {
        f"{p.namespace}/{p.name}": (p.redirect_frontend.address_matcher.ip, p.source)
        for p in c.stub.GetLrp(pb.GetLrpRequest()).lrps
    }


def test_documents_and_kubernetes_objects(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    tmp_path: Path,
) -> None:
    """CiliumLocalRedirectPolicy documents through CreateLrp, and objects
    from the stand-in API server: stored as policies of their source, which
    the other source can neither replace nor delete; an object gone or
    refused takes its policy with it."""
    kube_api = KubeListWatchServer().start()
    try:
        kube_api.apply("ciliumlocalredirectpolicies", cilium_lrp("from-k8s", "169.254.1.1"))
        kube_api.apply("ciliumlocalredirectpolicies", cilium_lrp("stale", "169.254.1.2"))
        kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
        lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig))
        c = LbClient(lb.address)
        wait_for(lambda: len(lrps_of(c)) == 2)
        assert lrps_of(c) == {
            "shop/from-k8s": ("169.254.1.1", "kubernetes"),
            "shop/stale": ("169.254.1.2", "kubernetes"),
        }

        # A document through the API: the same shape, source api.
        made = c.stub.CreateLrp(
            pb.CreateLrpRequest(document=json.dumps(cilium_lrp("from-api", "169.254.1.3")))
        )
        assert made.created
        assert made.lrp.source == "api"
        assert made.lrp.redirect_backend.to_ports[0].port == 8080
        bad = cilium_lrp("bad", "169.254.1.4")
        bad["spec"]["redirectBackend"]["toPorts"][0]["port"] = "http"
        err = rpc_error(c.stub.CreateLrp, pb.CreateLrpRequest(document=json.dumps(bad)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.details() or "").startswith("document.spec.redirectBackend.toPorts[0].port: ")
        err = rpc_error(c.stub.CreateLrp, pb.CreateLrpRequest(document="{not json"))
        assert (err.details() or "").startswith("document: ")

        # Neither source touches the other's.
        err = rpc_error(c.stub.DeleteLrp, pb.DeleteLrpRequest(namespace="shop", name="from-k8s"))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (err.details() or "").startswith("name: ")
        err = rpc_error(
            c.stub.CreateLrp,
            pb.CreateLrpRequest(document=json.dumps(cilium_lrp("from-k8s", "169.254.9.9"))),
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        kube_api.apply("ciliumlocalredirectpolicies", cilium_lrp("from-api", "169.254.9.9"))

        # Changed, deleted and refused objects.
        kube_api.apply("ciliumlocalredirectpolicies", cilium_lrp("from-k8s", "169.254.1.9"))
        kube_api.delete("ciliumlocalredirectpolicies", "shop", "stale")
        refused = cilium_lrp("refused", "169.254.1.5")
        refused["spec"]["skipRedirectFromBackend"] = True
        kube_api.apply("ciliumlocalredirectpolicies", refused)
        kube_api.apply("ciliumlocalredirectpolicies", cilium_lrp("later", "169.254.1.6"))
        want = {
            "shop/from-api": ("169.254.1.3", "api"),
            "shop/from-k8s": ("169.254.1.9", "kubernetes"),
            "shop/later": ("169.254.1.6", "kubernetes"),
        }
        assert wait_for(lambda: lrps_of(c) == want), lrps_of(c)
        assert c.stub.DeleteLrp(pb.DeleteLrpRequest(namespace="shop", name="from-api")).deleted
    finally:
        kube_api.stop()
