"""Network policy from the Kubernetes API: policy processes (real etcd,
real gRPC) follow NetworkPolicies, CiliumNetworkPolicies,
CiliumClusterwideNetworkPolicies and FlagellaNetworkPolicies.

No API server can run on these machines: the processes talk, with the
`kubernetes` client, to KubeListWatchServer (harness/kube_api.py), a local
HTTP server that stands in for the API server (list/watch, Leases, Events);
every test says so in its name."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from harness.aio import until
from harness.etcd import EtcdServer
from harness.kube_api import POLICY_KINDS, KubeListWatchServer, k8s_policy
from harness.lb import wait_for
from harness.procs import SERVING, ServiceProcess

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg

pytestmark = pytest.mark.integration

# Fast elections: a dead leader is replaced within about 2 s.
LEADER_FLAGS = (
    "--leader-lease-duration", "2",
    "--leader-renew-deadline", "1.5",
    "--leader-retry-period", "0.25",
)  # fmt: skip
NAMESPACE = "flagella"
KUBERNETES_HEALTH = "flagella.kubernetes"

WEB_SPEC = {
    "podSelector": {"matchLabels": {"app": "web"}},
    "ingress": [
        {
            "from": [{"podSelector": {"matchLabels": {"app": "frontend"}}}],
            "ports": [{"port": 8080, "protocol": "TCP"}],
        }
    ],
}
CNP_SPEC = {
    "endpointSelector": {"matchLabels": {"app": "web"}},
    "ingress": [
        {
            "fromEndpoints": [{"matchLabels": {"app": "frontend"}}],
            "toPorts": [{"ports": [{"port": "8080", "protocol": "TCP"}]}],
        }
    ],
}


def spec_of(kind: str, port: int = 8080) -> dict[str, Any]:
    """WEB_SPEC in the kind's own fields, allowing port."""
    if kind == "NetworkPolicy":
        spec: dict[str, Any] = {**WEB_SPEC}
        spec["ingress"] = [{**WEB_SPEC["ingress"][0], "ports": [{"port": port, "protocol": "TCP"}]}]
        return spec
    spec = {**CNP_SPEC}
    spec["ingress"] = [
        {
            **CNP_SPEC["ingress"][0],
            "toPorts": [{"ports": [{"port": str(port), "protocol": "TCP"}]}],
        }
    ]
    return spec


def apply(api: KubeListWatchServer, kind: str, ns: str, name: str, spec: dict[str, Any]) -> int:
    resource, _ = POLICY_KINDS[kind]
    return api.apply(resource, k8s_policy(kind, ns, name, spec))


@pytest.fixture
def kube_api() -> Iterator[KubeListWatchServer]:
    with KubeListWatchServer() as server:
        yield server


class Policy:
    """A policy process and a client of it."""

    def __init__(self, proc: ServiceProcess) -> None:
        self.proc = proc
        self.channel = proc.channel()
        self.stub = pbg.PolicyServiceStub(self.channel)

    def rules(self) -> dict[str, pb.Rule]:
        got = self.stub.ListRules(pb.ListRulesRequest(), timeout=10)
        return {r.name: r for r in got.rules}

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def start_policy(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], kube_api: KubeListWatchServer,
    tmp_path: Path,
) -> Iterator[Callable[..., Policy]]:  # fmt: skip
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    clients: list[Policy] = []

    def start(*extra: str, kube: bool = True) -> Policy:
        args = ["--etcd-endpoints", etcd.endpoint, *extra]
        if kube:
            args += ["--kubeconfig", str(kubeconfig), *LEADER_FLAGS]
        client = Policy(spawn("policy", *args))
        clients.append(client)
        return client

    yield start
    for c in clients:
        c.close()


def etcd_revision(etcd: EtcdServer) -> int:
    async def read() -> int:
        client = etcd.client()
        try:
            return await client.current_revision()
        finally:
            await client.close()

    return asyncio.run(read())


def content(rule: pb.Rule) -> pb.Rule:
    """The rule without its name, source and what the store sets."""
    out = pb.Rule()
    out.CopyFrom(rule)
    for f in ("name", "revision", "updated_at", "source"):
        out.ClearField(f)  # type: ignore[arg-type]
    return out


def test_each_kind_from_the_stand_in_api_server_is_one_rule_that_follows_its_object(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy], etcd: EtcdServer
) -> None:
    for kind in POLICY_KINDS:
        ns = "" if kind == "CiliumClusterwideNetworkPolicy" else "shop"
        apply(kube_api, kind, ns, "web", spec_of(kind))
    p = start_policy()
    # The same NetworkPolicy imported by hand: a rule of its own.
    hand_doc = (
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        "metadata: {name: web, namespace: shop}\n"
        "spec: {podSelector: {matchLabels: {app: web}}, ingress: [{from: [{podSelector: "
        "{matchLabels: {app: frontend}}}], ports: [{port: 8080, protocol: TCP}]}]}\n"
    )
    p.stub.PutRules(pb.PutRulesRequest(document=hand_doc), timeout=10)
    names = {
        "shop/web",
        "NetworkPolicy/shop/web",
        "CiliumNetworkPolicy/shop/web",
        "CiliumClusterwideNetworkPolicy/web",
        "FlagellaNetworkPolicy/shop/web",
    }
    wait_for(lambda: set(p.rules()) == names)
    rules = p.rules()
    # Translated exactly as `flagella policy import` translates it.
    assert content(rules["NetworkPolicy/shop/web"]) == content(rules["shop/web"])
    assert not rules["shop/web"].HasField("source")
    src = rules["CiliumClusterwideNetworkPolicy/web"].source
    assert (src.kind, src.namespace, src.name) == ("CiliumClusterwideNetworkPolicy", "", "web")
    assert rules["CiliumClusterwideNetworkPolicy/web"].namespace == ""
    assert rules["FlagellaNetworkPolicy/shop/web"].namespace == "shop"

    # An update is one revision (one etcd transaction) that changes the rule.
    before = etcd_revision(etcd)
    apply(kube_api, "CiliumNetworkPolicy", "shop", "web", spec_of("CiliumNetworkPolicy", 9090))

    def port_of(name: str) -> int | None:
        rule = p.rules().get(name)
        return rule.ingress[0].to_ports[0].ports[0].port if rule else None

    wait_for(lambda: port_of("CiliumNetworkPolicy/shop/web") == 9090)
    assert etcd_revision(etcd) == before + 1
    assert p.rules()["CiliumNetworkPolicy/shop/web"].revision == before + 1

    # The API cannot delete what Kubernetes owns.
    with pytest.raises(grpc.RpcError) as err:
        p.stub.DeleteRule(pb.DeleteRuleRequest(name="NetworkPolicy/shop/web"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "NetworkPolicy shop/web" in (err.value.details() or "")

    # Deleted in Kubernetes: its rule goes; the rule by hand stays.
    for kind in POLICY_KINDS:
        resource, _ = POLICY_KINDS[kind]
        kube_api.delete(resource, "" if kind.startswith("CiliumCluster") else "shop", "web")
    wait_for(lambda: set(p.rules()) == {"shop/web"})


def test_an_invalid_object_gets_an_event_from_the_stand_in_api_server_and_blocks_nothing(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy]
) -> None:
    apply(kube_api, "NetworkPolicy", "shop", "good", spec_of("NetworkPolicy"))
    apply(kube_api, "NetworkPolicy", "shop", "bad", spec_of("NetworkPolicy", 99999))
    p = start_policy()
    wait_for(lambda: "NetworkPolicy/shop/good" in p.rules())
    events = wait_for(lambda: kube_api.events_about("NetworkPolicy", "shop", "bad"))
    assert len(events) == 1
    event = events[0]
    assert event["type"] == "Warning"
    assert event["reason"] == "InvalidPolicy"
    assert "spec.ingress[0].ports[0].port" in event["message"]
    assert event["involvedObject"]["uid"]
    assert event["metadata"]["namespace"] == "shop"
    assert "NetworkPolicy/shop/bad" not in p.rules()
    assert "kubernetes policy not valid, nothing applied from it" in p.proc.logs()

    # A valid object turned invalid keeps its last valid rule (dropping it
    # would open what it closed) and gets its Event; the others go on.
    good_rev = p.rules()["NetworkPolicy/shop/good"].revision
    apply(
        kube_api, "NetworkPolicy", "shop", "good", {"podSelector": {}, "policyTypes": ["Sideways"]}
    )
    wait_for(lambda: kube_api.events_about("NetworkPolicy", "shop", "good"))
    apply(kube_api, "NetworkPolicy", "shop", "other", spec_of("NetworkPolicy"))
    wait_for(lambda: "NetworkPolicy/shop/other" in p.rules())
    assert p.rules()["NetworkPolicy/shop/good"].revision == good_rev
    assert (
        "spec.policyTypes[0]"
        in kube_api.events_about("NetworkPolicy", "shop", "good")[0]["message"]
    )
    # Fixed: applied.
    apply(kube_api, "NetworkPolicy", "shop", "bad", spec_of("NetworkPolicy", 8443))
    wait_for(lambda: "NetworkPolicy/shop/bad" in p.rules())


def test_a_first_full_sync_from_the_stand_in_api_server_replaces_what_an_earlier_run_left(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy]
) -> None:
    for name in ("a", "b", "c"):
        apply(kube_api, "CiliumNetworkPolicy", "shop", name, spec_of("CiliumNetworkPolicy"))
    p = start_policy()
    wait_for(lambda: len(p.rules()) == 3)
    p.stub.PutRules(pb.PutRulesRequest(document=HAND_DOC), timeout=10)
    hand = p.rules()["shop/by-hand"]
    kept = p.rules()["CiliumNetworkPolicy/shop/a"]
    p.proc.stop()

    # While no policy process runs: b goes, c changes, d comes, history goes.
    kube_api.delete("ciliumnetworkpolicies", "shop", "b")
    apply(kube_api, "CiliumNetworkPolicy", "shop", "c", spec_of("CiliumNetworkPolicy", 7070))
    apply(kube_api, "CiliumNetworkPolicy", "shop", "d", spec_of("CiliumNetworkPolicy"))
    kube_api.compact()
    p = start_policy()
    names = {"shop/by-hand", *(f"CiliumNetworkPolicy/shop/{n}" for n in "acd")}
    wait_for(lambda: set(p.rules()) == names)
    rules = p.rules()
    wait_for(
        lambda: p.rules()["CiliumNetworkPolicy/shop/c"].ingress[0].to_ports[0].ports[0].port == 7070
    )
    # Untouched: the rule by hand, and the rule its object did not change.
    assert rules["shop/by-hand"] == hand
    assert rules["CiliumNetworkPolicy/shop/a"].revision == kept.revision


HAND_DOC = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: by-hand, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: db}}
  ingress: [{fromEndpoints: [{matchLabels: {app: web}}]}]
"""


def test_the_stand_in_api_server_away_rules_stay_status_says_so_and_watchers_resync(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy]
) -> None:
    apply(kube_api, "NetworkPolicy", "shop", "a", spec_of("NetworkPolicy"))
    apply(kube_api, "FlagellaNetworkPolicy", "shop", "b", spec_of("FlagellaNetworkPolicy"))
    p = start_policy()
    wait_for(lambda: len(p.rules()) == 2)
    wait_for(lambda: p.proc.health(KUBERNETES_HEALTH) == SERVING)
    before = p.rules()

    kube_api.down()
    wait_for(lambda: p.proc.health(KUBERNETES_HEALTH) == health_pb2.HealthCheckResponse.NOT_SERVING)
    # Still serving, the rules still there and unchanged.
    assert p.proc.health() == SERVING
    assert p.rules() == before
    kube_api.delete("networkpolicies", "shop", "a")
    apply(kube_api, "NetworkPolicy", "shop", "c", spec_of("NetworkPolicy"))
    time.sleep(1.0)
    assert p.rules() == before

    kube_api.up()
    wait_for(lambda: set(p.rules()) == {"NetworkPolicy/shop/c", "FlagellaNetworkPolicy/shop/b"})
    wait_for(lambda: p.proc.health(KUBERNETES_HEALTH) == SERVING)
    assert p.rules()["FlagellaNetworkPolicy/shop/b"] == before["FlagellaNetworkPolicy/shop/b"]


def holders(kube_api: KubeListWatchServer) -> dict[str, str]:
    out = {}
    for resource, _ in POLICY_KINDS.values():
        lease = kube_api.lease(NAMESPACE, f"flagella-policy-{resource}")
        out[resource] = lease["spec"]["holderIdentity"] if lease else ""
    return out


def test_two_replicas_on_the_stand_in_api_server_one_leader_per_watcher_and_a_takeover(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy], etcd: EtcdServer
) -> None:
    for i in range(5):
        apply(kube_api, "NetworkPolicy", "shop", f"p{i}", spec_of("NetworkPolicy", 8000 + i))
        apply(
            kube_api, "CiliumClusterwideNetworkPolicy", "", f"c{i}", spec_of("CiliumNetworkPolicy")
        )
    a = start_policy()
    wait_for(lambda: all(holders(kube_api).values()))
    b = start_policy()
    wait_for(lambda: len(b.rules()) == 10)
    held = holders(kube_api)
    first = held["networkpolicies"]
    # b follows: every Lease still has a's holder after several of b's tries.
    time.sleep(1.0)
    assert holders(kube_api) == held
    assert len(set(held.values())) == 1
    revisions = {n: r.revision for n, r in b.rules().items()}

    # kill -9 the leader: b takes every watcher over within the lease
    # duration (2 s) plus its tries, and writes what changes after.
    a.proc.kill9()
    killed = time.monotonic()
    wait_for(lambda: all(h and h != first for h in holders(kube_api).values()), timeout=10)
    assert time.monotonic() - killed < 2 + 2 * 0.25 * 2.2 + 1.0
    apply(kube_api, "NetworkPolicy", "shop", "p5", spec_of("NetworkPolicy", 8005))
    kube_api.delete("ciliumclusterwidenetworkpolicies", "", "c0")
    wait_for(lambda: "NetworkPolicy/shop/p5" in b.rules())
    wait_for(lambda: "CiliumClusterwideNetworkPolicy/c0" not in b.rules())
    rules = b.rules()
    # No rule lost or duplicated, and the new leader's full sync rewrote
    # nothing its objects did not change.
    assert sorted(rules) == sorted(
        [f"NetworkPolicy/shop/p{i}" for i in range(6)]
        + [f"CiliumClusterwideNetworkPolicy/c{i}" for i in range(1, 5)]
    )
    assert all(rules[n].revision == revisions[n] for n in rules if n in revisions)
    assert [
        r.ingress[0].to_ports[0].ports[0].port for n, r in sorted(rules.items()) if "shop/p" in n
    ] == [8000 + i for i in range(6)]


def test_a_watch_ended_with_410_gone_by_the_stand_in_api_server_writes_only_the_difference(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy]
) -> None:
    for i in range(20):
        apply(kube_api, "FlagellaNetworkPolicy", "shop", f"f{i}", spec_of("FlagellaNetworkPolicy"))
    p = start_policy()
    wait_for(lambda: len(p.rules()) == 20)
    before = {n: r.revision for n, r in p.rules().items()}
    gone = kube_api.gone_sent
    kube_api.expire_watches()
    apply(kube_api, "FlagellaNetworkPolicy", "shop", "f3", spec_of("FlagellaNetworkPolicy", 9999))
    wait_for(
        lambda: (
            p.rules()["FlagellaNetworkPolicy/shop/f3"].revision
            != before["FlagellaNetworkPolicy/shop/f3"]
        )
    )
    assert kube_api.gone_sent > gone
    after = {n: r.revision for n, r in p.rules().items()}
    assert {n for n in after if after[n] != before[n]} == {"FlagellaNetworkPolicy/shop/f3"}
    assert "kubernetes list/watch interrupted, listing again" in p.proc.logs()


async def test_the_invalid_object_counter_with_the_stand_in_api_server_in_process(
    kube_api: KubeListWatchServer, etcd: EtcdServer, tmp_path: Path
) -> None:
    """The watchers in this process (real etcd, the real kubernetes client),
    to read their counters: one invalid object counts once per version,
    however often it is looked at."""
    from flagella.common.leader import Election
    from flagella.common.tasks import TaskGroup
    from flagella.policy.kube import PolicyWatchers
    from flagella.policy.service import PolicyService
    from flagella.policy.store import PolicyStore

    apply(
        kube_api,
        "CiliumNetworkPolicy",
        "shop",
        "bad",
        {"endpointSelector": {}, "ingress": [{"toFQDNs": []}]},
    )
    apply(kube_api, "CiliumNetworkPolicy", "shop", "good", spec_of("CiliumNetworkPolicy"))
    client = etcd.client()
    async with TaskGroup() as tasks:
        service = PolicyService(PolicyStore(client), tasks=tasks)
        await service.start()
        kube = PolicyWatchers(service.rules, str(kube_api.write_kubeconfig(tmp_path / "kc")))
        await kube.start(tasks, Election(NAMESPACE, "me"))
        cnp = next(w for w in kube.watchers if w.kind.kind == "CiliumNetworkPolicy")
        await asyncio.wait_for(cnp.synced.wait(), 10)
        assert cnp.invalid_objects == 1
        assert cnp.writes == 1
        assert set(service.state.rules) == {"CiliumNetworkPolicy/shop/good"}
        # The Event is written after the count (its own API call): wait for it.
        await until(lambda: bool(kube_api.events_about("CiliumNetworkPolicy", "shop", "bad")), 10)
        events = kube_api.events_about("CiliumNetworkPolicy", "shop", "bad")
        assert [e["message"] for e in events] == [
            "not enforced: spec.ingress[0].toFQDNs: unknown field: toFQDNs is an egress field"
        ]
        # Looked at again (a relist), the same version: no second report.
        kube_api.expire_watches()
        rev = apply(
            kube_api, "CiliumNetworkPolicy", "shop", "good2", spec_of("CiliumNetworkPolicy")
        )
        await cnp.table.wait_for(rev, 10)
        await until(lambda: "CiliumNetworkPolicy/shop/good2" in service.state.rules, 10)
        assert cnp.invalid_objects == 1
        # A new version, still invalid: counted and reported again.
        apply(
            kube_api,
            "CiliumNetworkPolicy",
            "shop",
            "bad",
            {"endpointSelector": {}, "egress": [{"toPorts": [{"rules": {}}]}]},
        )
        await until(lambda: cnp.invalid_objects == 2, 10)
        await until(
            lambda: len(kube_api.events_about("CiliumNetworkPolicy", "shop", "bad")) >= 2, 10
        )
        assert len(kube_api.events_about("CiliumNetworkPolicy", "shop", "bad")) == 2
    await kube.stop()
    await client.close()


def test_only_the_kinds_asked_for_are_followed_on_the_stand_in_api_server(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy]
) -> None:
    apply(kube_api, "NetworkPolicy", "shop", "a", spec_of("NetworkPolicy"))
    apply(kube_api, "CiliumNetworkPolicy", "shop", "b", spec_of("CiliumNetworkPolicy"))
    p = start_policy("--kubernetes-policy-kinds", "NetworkPolicy")
    wait_for(lambda: set(p.rules()) == {"NetworkPolicy/shop/a"})
    wait_for(lambda: p.proc.health(KUBERNETES_HEALTH) == SERVING)
    assert not any("cilium" in r for r in kube_api.requests)
    assert holders(kube_api)["ciliumnetworkpolicies"] == ""


def cidr_group_object(name: str, cidrs: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2alpha1",
        "kind": "CiliumCIDRGroup",
        "metadata": {"name": name, "labels": {"team": "edge"}},
        "spec": {"externalCIDRs": cidrs},
    }


def test_cilium_cidr_groups_from_the_stand_in_api_server_are_the_groups_rules_reference(
    kube_api: KubeListWatchServer, start_policy: Callable[..., Policy]
) -> None:
    groups_resource = "ciliumcidrgroups"
    kube_api.apply(groups_resource, cidr_group_object("partners", ["192.0.2.0/24"]))
    p = start_policy()
    # A rule by hand names the group; its CIDR identities follow the object.
    p.stub.PutRules(
        pb.PutRulesRequest(
            document=(
                "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\n"
                "metadata: {name: out, namespace: shop}\n"
                "spec: {endpointSelector: {}, egress: [{toCIDRSet: [{cidrGroupRef: partners}]}]}\n"
            )
        ),
        timeout=10,
    )

    def groups() -> dict[str, pb.CIDRGroup]:
        got = p.stub.ListCIDRGroups(pb.ListCIDRGroupsRequest(), timeout=10)
        return {g.name: g for g in got.groups}

    def cidr_prefixes() -> set[str]:
        got = p.stub.ListIPCache(pb.ListIPCacheRequest(), timeout=10)
        return {e.prefix for e in got.entries if e.source == "cidr-policy"}

    wait_for(lambda: "partners" in groups())
    group = groups()["partners"]
    assert list(group.cidrs) == ["192.0.2.0/24"]
    assert dict(group.labels) == {"team": "edge"}
    assert (group.source.kind, group.source.name) == ("CiliumCIDRGroup", "partners")
    wait_for(lambda: cidr_prefixes() == {"192.0.2.0/24"})

    # The API cannot change or delete what Kubernetes owns.
    for call, request in (
        (p.stub.PutCIDRGroup, pb.CIDRGroup(name="partners", cidrs=["10.0.0.0/8"])),
        (p.stub.DeleteCIDRGroup, pb.DeleteCIDRGroupRequest(name="partners")),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "CiliumCIDRGroup partners" in (err.value.details() or "")

    # Edited in place: the group and the rule's CIDR identities follow.
    kube_api.apply(
        groups_resource, cidr_group_object("partners", ["198.51.100.0/24", "2001:db8::/64"])
    )
    wait_for(lambda: cidr_prefixes() == {"198.51.100.0/24", "2001:db8::/64"})
    assert list(groups()["partners"].cidrs) == ["198.51.100.0/24", "2001:db8::/64"]

    # A group by hand of another name is left alone; one of an object's name
    # is replaced by the object (Kubernetes is the source of truth).
    p.stub.PutCIDRGroup(pb.CIDRGroup(name="mine", cidrs=["203.0.113.0/24"]), timeout=10)
    p.stub.PutCIDRGroup(pb.CIDRGroup(name="later", cidrs=["203.0.113.0/24"]), timeout=10)
    kube_api.apply(groups_resource, cidr_group_object("later", ["100.64.0.0/10"]))
    wait_for(lambda: groups()["later"].source.kind == "CiliumCIDRGroup")
    assert list(groups()["later"].cidrs) == ["100.64.0.0/10"]

    # Invalid (host bits): an Event naming the field; its last valid version stays.
    kube_api.apply(groups_resource, cidr_group_object("partners", ["198.51.100.7/24"]))
    events = wait_for(lambda: kube_api.events_about("CiliumCIDRGroup", "", "partners"))
    assert "spec.externalCIDRs[0]" in events[0]["message"]
    assert list(groups()["partners"].cidrs) == ["198.51.100.0/24", "2001:db8::/64"]

    # Deleted in Kubernetes: the group goes, and the rule's CIDRs with it
    # (a missing group selects nothing); the group by hand stays.
    kube_api.delete(groups_resource, "", "partners")
    kube_api.delete(groups_resource, "", "later")
    wait_for(lambda: set(groups()) == {"mine"})
    wait_for(lambda: cidr_prefixes() == set())
