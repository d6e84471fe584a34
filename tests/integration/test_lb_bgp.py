"""BGP peering policies on the lb service, against a real etcd and a real lb
process: validation (code, field, nothing stored), storage (upsert,
replace, list, delete), passwords taken and never returned (but streamed to
nodes), the WatchBgpPeeringPolicies stream (snapshot, changes, resume),
CiliumBGPPeeringPolicy documents, and objects (with their Secrets) from a
stand-in Kubernetes API server (harness/kube_api.py)."""

from __future__ import annotations

import base64
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


@pytest.fixture(scope="module")
def lb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, LbClient]]:
    with lb_with_etcd(tmp_path_factory.mktemp("lb-bgp")) as suite:
        yield suite


def policy(name: str = "rack1", password: str = "") -> pb.BgpPeeringPolicy:
    p = pb.BgpPeeringPolicy(name=name)
    p.node_selector.match_labels["rack"] = "r1"
    vr = p.virtual_routers.add(local_asn=65001, export_pod_cidr=True)
    vr.service_selector.match_expressions.add(key="advertise", operator="In", values=["bgp"])
    vr.neighbors.add(
        peer_address="192.168.100.253/32",
        peer_asn=64512,
        hold_time_seconds=9,
        keep_alive_time_seconds=3,
        password=password,
    )
    vr.neighbors.add(peer_address="fd00:100::253", peer_asn=64512)
    return p


def _set(path: str, value: object) -> Callable[[pb.BgpPeeringPolicy], None]:
    def edit(p: pb.BgpPeeringPolicy) -> None:
        *parents, last = path.split(".")
        target: Any = p
        for part in parents:
            name, _, index = part.partition("[")
            target = getattr(target, name)
            if index:
                target = target[int(index[:-1])]
        setattr(target, last, value)

    return edit


def _second_router_same_asn(p: pb.BgpPeeringPolicy) -> None:
    p.virtual_routers.add(local_asn=65001)


def _bad_operator(p: pb.BgpPeeringPolicy) -> None:
    p.virtual_routers[0].service_selector.match_expressions[0].operator = "Near"


def _bad_node_key(p: pb.BgpPeeringPolicy) -> None:
    p.node_selector.match_labels["bad key!"] = "x"


def _bad_node_expression_key(p: pb.BgpPeeringPolicy) -> None:
    p.node_selector.match_expressions.add(key="-nope-", operator="Exists")


def _twice(p: pb.BgpPeeringPolicy) -> None:
    p.virtual_routers[0].neighbors.add(peer_address="192.168.100.253", peer_asn=1)


def _no_routers(p: pb.BgpPeeringPolicy) -> None:
    p.ClearField("virtual_routers")


def _secret_ref(p: pb.BgpPeeringPolicy) -> None:
    p.virtual_routers[0].neighbors[0].auth_secret_ref = "bgp-auth"


VR = "policy.virtual_routers[0]"
N0 = f"{VR}.neighbors[0]"
BAD = [
    (_set("name", ""), "policy.name"),
    (_set("name", "A/B"), "policy.name"),
    (_no_routers, "policy.virtual_routers"),
    (_set("virtual_routers[0].local_asn", 0), f"{VR}.local_asn"),
    (_set("virtual_routers[0].local_asn", 4294967296), f"{VR}.local_asn"),
    (_set("virtual_routers[0].local_asn", -1), f"{VR}.local_asn"),
    (_second_router_same_asn, "policy.virtual_routers[1].local_asn"),
    (_set("virtual_routers[0].router_id", "not-an-ip"), f"{VR}.router_id"),
    (_set("virtual_routers[0].router_id", "fd00::1"), f"{VR}.router_id"),
    (_set("virtual_routers[0].neighbors[0].peer_address", "bogus"), f"{N0}.peer_address"),
    (_set("virtual_routers[0].neighbors[0].peer_address", "10.0.0.0/24"), f"{N0}.peer_address"),
    (_set("virtual_routers[0].neighbors[0].peer_address", ""), f"{N0}.peer_address"),
    (_set("virtual_routers[0].neighbors[0].peer_asn", 0), f"{N0}.peer_asn"),
    (_set("virtual_routers[0].neighbors[0].peer_asn", 1 << 40), f"{N0}.peer_asn"),
    (_set("virtual_routers[0].neighbors[0].peer_port", 70000), f"{N0}.peer_port"),
    (_set("virtual_routers[0].neighbors[0].hold_time_seconds", 2), f"{N0}.hold_time_seconds"),
    (_set("virtual_routers[0].neighbors[0].hold_time_seconds", 70000), f"{N0}.hold_time_seconds"),
    (_set("virtual_routers[0].neighbors[0].keep_alive_time_seconds", 10), f"{N0}.keep_alive_time_seconds"),
    (_set("virtual_routers[0].neighbors[0].connect_retry_time_seconds", 70000), f"{N0}.connect_retry_time_seconds"),
    (_set("virtual_routers[0].neighbors[0].ebgp_multihop_ttl", 256), f"{N0}.ebgp_multihop_ttl"),
    (_set("virtual_routers[0].neighbors[0].password", "x" * 81), f"{N0}.password"),
    (_secret_ref, f"{N0}.auth_secret_ref"),
    (_twice, f"{VR}.neighbors[2].peer_address"),
    (_bad_operator, f"{VR}.service_selector.match_expressions[0].operator"),
    (_bad_node_key, "policy.node_selector.match_labels[bad key!]"),
    (_bad_node_expression_key, "policy.node_selector.match_expressions[0].key"),
]  # fmt: skip


def test_invalid_policies_name_the_field_and_store_nothing(
    lb: tuple[EtcdServer, LbClient],
) -> None:
    etcd, c = lb
    before = etcd_dump(etcd)
    for edit, field in BAD:
        p = policy()
        edit(p)
        err = rpc_error(
            c.stub.UpsertBgpPeeringPolicy, pb.UpsertBgpPeeringPolicyRequest(policy=p), timeout=10
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
        assert (err.details() or "").startswith(f"{field}: "), (field, err.details())
    err = rpc_error(c.stub.UpsertBgpPeeringPolicy, pb.UpsertBgpPeeringPolicyRequest())
    assert (err.details() or "").startswith("policy: ")
    err = rpc_error(c.stub.DeleteBgpPeeringPolicy, pb.DeleteBgpPeeringPolicyRequest(name="No Such"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("name: ")
    assert etcd_dump(etcd) == before


def test_upsert_list_delete_watch_and_passwords(lb: tuple[EtcdServer, LbClient]) -> None:
    etcd, c = lb
    stream = c.stub.WatchBgpPeeringPolicies(pb.WatchBgpPeeringPoliciesRequest(), timeout=60)
    assert next(stream).kind == pb.BgpPeeringPolicyEvent.KIND_RESET
    assert next(stream).kind == pb.BgpPeeringPolicyEvent.KIND_SYNCED

    made = c.stub.UpsertBgpPeeringPolicy(
        pb.UpsertBgpPeeringPolicyRequest(policy=policy(password="s3cret")), timeout=10
    )
    assert made.created
    got = made.policy
    assert got.source == "api"
    assert got.revision > 0
    n0, n1 = got.virtual_routers[0].neighbors
    # Canonical: a host prefix is its address; defaults filled in.
    assert (n0.peer_address, n0.peer_port, n0.hold_time_seconds) == ("192.168.100.253", 179, 9)
    assert (n1.hold_time_seconds, n1.keep_alive_time_seconds) == (90, 30)
    assert (n1.connect_retry_time_seconds, n1.ebgp_multihop_ttl) == (120, 1)
    # The password is taken, never returned...
    assert n0.password == ""
    assert n0.has_password
    assert not n1.has_password
    listed = c.stub.ListBgpPeeringPolicies(pb.ListBgpPeeringPoliciesRequest(), timeout=10)
    assert list(listed.policies) == [got]
    assert (
        b"s3cret"
        not in json.dumps(
            {k: v.decode() for k, v in etcd_dump(etcd).items() if "/bgp/" not in k}
        ).encode()
    )
    # ...but the nodes' stream carries it (only nodes may call it: authz).
    ev = next(stream)
    assert ev.kind == pb.BgpPeeringPolicyEvent.KIND_UPSERT
    assert ev.policy.virtual_routers[0].neighbors[0].password == "s3cret"
    assert ev.revision == got.revision
    assert set(etcd_dump(etcd, "flagella/lb/v1/bgp/")) == {"flagella/lb/v1/bgp/policies/rack1"}

    # The same again writes nothing; a change replaces it.
    again = c.stub.UpsertBgpPeeringPolicy(
        pb.UpsertBgpPeeringPolicyRequest(policy=policy(password="s3cret")), timeout=10
    )
    assert not again.created
    assert again.policy == got
    changed = policy(password="s3cret")
    changed.virtual_routers[0].export_pod_cidr = False
    replaced = c.stub.UpsertBgpPeeringPolicy(
        pb.UpsertBgpPeeringPolicyRequest(policy=changed), timeout=10
    )
    assert not replaced.created
    assert replaced.policy.revision > got.revision
    assert next(stream).policy.virtual_routers[0].export_pod_cidr is False

    deleted = c.stub.DeleteBgpPeeringPolicy(pb.DeleteBgpPeeringPolicyRequest(name="rack1"))
    assert deleted.deleted
    assert not c.stub.DeleteBgpPeeringPolicy(pb.DeleteBgpPeeringPolicyRequest(name="rack1")).deleted
    ev = next(stream)
    assert ev.kind == pb.BgpPeeringPolicyEvent.KIND_DELETE
    assert ev.policy.name == "rack1"
    stream.cancel()
    resumed = c.stub.WatchBgpPeeringPolicies(
        pb.WatchBgpPeeringPoliciesRequest(since_revision=replaced.policy.revision), timeout=60
    )
    assert next(resumed).kind == pb.BgpPeeringPolicyEvent.KIND_SYNCED
    ev = next(resumed)
    assert ev.kind == pb.BgpPeeringPolicyEvent.KIND_DELETE
    resumed.cancel()


def cilium_policy(name: str, asn: int, secret: str = "") -> dict[str, Any]:
    """A CiliumBGPPeeringPolicy object as Kubernetes serves it."""
    neighbor: dict[str, Any] = {
        "peerAddress": "10.0.0.1/32",
        "peerASN": 64512,
        "holdTimeSeconds": 9,
        "keepAliveTimeSeconds": 3,
    }
    if secret:
        neighbor["authSecretRef"] = secret
    return {
        "apiVersion": "cilium.io/v2alpha1",
        "kind": "CiliumBGPPeeringPolicy",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"matchLabels": {"bgp": "yes"}},
            "virtualRouters": [
                {
                    "localASN": asn,
                    "exportPodCIDR": True,
                    "serviceSelector": {
                        "matchExpressions": [{"key": "somekey", "operator": "NotIn", "values": ["never-used-value"]}]
                    },
                    "neighbors": [neighbor],
                }
            ],
        },
    }  # fmt: skip


def policies_of(c: LbClient) -> dict[str, tuple[int, str, bool]]:
    """name: (local ASN, source, whether its first neighbour has a password)."""
    return {
        p.name: (
            p.virtual_routers[0].local_asn,
            p.source,
            p.virtual_routers[0].neighbors[0].has_password,
        )
        for p in c.stub.ListBgpPeeringPolicies(pb.ListBgpPeeringPoliciesRequest()).policies
    }


def test_documents_and_kubernetes_objects(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    tmp_path: Path,
) -> None:
    """CiliumBGPPeeringPolicy documents through the API, and objects from the
    stand-in API server (a neighbour's password read from its Secret):
    policies of their source, which the other can neither replace nor
    delete; an object gone or refused takes its policy with it."""
    kube_api = KubeListWatchServer().start()
    try:
        password = base64.b64encode(b"from-secret").decode()
        kube_api.apply(
            "secrets",
            {"metadata": {"namespace": "kube-system", "name": "bgp-auth"},
             "data": {"password": password}},
        )  # fmt: skip
        kube_api.apply("ciliumbgppeeringpolicies", cilium_policy("from-k8s", 65001, "bgp-auth"))
        kube_api.apply("ciliumbgppeeringpolicies", cilium_policy("stale", 65002))
        kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
        lb = spawn("lb", "--etcd-endpoints", etcd.endpoint, "--kubeconfig", str(kubeconfig))
        c = LbClient(lb.address)
        want = {"from-k8s": (65001, "kubernetes", True), "stale": (65002, "kubernetes", False)}
        assert wait_for(lambda: policies_of(c) == want), policies_of(c)

        # A document through the API: the same shape, source api.
        made = c.stub.UpsertBgpPeeringPolicy(
            pb.UpsertBgpPeeringPolicyRequest(document=json.dumps(cilium_policy("from-api", 65003)))
        )
        assert made.created
        assert made.policy.source == "api"
        assert made.policy.virtual_routers[0].neighbors[0].peer_address == "10.0.0.1"
        bad = cilium_policy("bad", 65004)
        bad["spec"]["virtualRouters"][0]["neighbors"][0]["peerASN"] = "lots"
        err = rpc_error(
            c.stub.UpsertBgpPeeringPolicy,
            pb.UpsertBgpPeeringPolicyRequest(document=json.dumps(bad)),
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.details() or "").startswith(
            "document.spec.virtualRouters[0].neighbors[0].peerASN: "
        ), err.details()
        with_ref = cilium_policy("ref", 65005, "bgp-auth")
        err = rpc_error(
            c.stub.UpsertBgpPeeringPolicy,
            pb.UpsertBgpPeeringPolicyRequest(document=json.dumps(with_ref)),
        )
        assert (err.details() or "").startswith(
            "document.spec.virtualRouters[0].neighbors[0].authSecretRef: "
        ), err.details()

        # Neither source touches the other's.
        err = rpc_error(
            c.stub.DeleteBgpPeeringPolicy, pb.DeleteBgpPeeringPolicyRequest(name="from-k8s")
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        err = rpc_error(
            c.stub.UpsertBgpPeeringPolicy,
            pb.UpsertBgpPeeringPolicyRequest(document=json.dumps(cilium_policy("from-k8s", 1))),
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        kube_api.apply("ciliumbgppeeringpolicies", cilium_policy("from-api", 65009))

        # Changed, deleted and refused objects.
        kube_api.apply("ciliumbgppeeringpolicies", cilium_policy("from-k8s", 65011, "bgp-auth"))
        kube_api.delete("ciliumbgppeeringpolicies", "", "stale")
        refused = cilium_policy("refused", 65012)
        refused["spec"]["virtualRouters"][0]["localASN"] = 0
        kube_api.apply("ciliumbgppeeringpolicies", refused)
        missing = cilium_policy("no-secret", 65013, "no-such-secret")
        kube_api.apply("ciliumbgppeeringpolicies", missing)
        kube_api.apply("ciliumbgppeeringpolicies", cilium_policy("later", 65014))
        want = {
            "from-api": (65003, "api", False),
            "from-k8s": (65011, "kubernetes", True),
            "later": (65014, "kubernetes", False),
        }
        assert wait_for(lambda: policies_of(c) == want), policies_of(c)
        # The Secret's password reached the nodes' stream.
        stream = c.stub.WatchBgpPeeringPolicies(pb.WatchBgpPeeringPoliciesRequest(), timeout=30)
        passwords = {}
        for event in stream:
            if event.kind == pb.BgpPeeringPolicyEvent.KIND_SYNCED:
                break
            if event.kind == pb.BgpPeeringPolicyEvent.KIND_UPSERT:
                passwords[event.policy.name] = event.policy.virtual_routers[0].neighbors[0].password
        stream.cancel()
        assert passwords == {"from-api": "", "from-k8s": "from-secret", "later": ""}
    finally:
        kube_api.stop()
