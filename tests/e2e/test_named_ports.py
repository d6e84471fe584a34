"""End to end: named ports. Real pods (network namespaces set up by
`flagella-cni ADD`; with `kubernetes: true` the endpoint service reads the
Pod, whose containers' ports have names), the datapath's BPF programs in a
node netns, NetworkPolicies naming ports written to the API server. No API
server can run here: the policy and endpoint services follow
KubeListWatchServer (harness/kube_api.py), which stands in for it; the
test names say so.

One cluster for the module; each test has its own pods and policies and
removes its policies. Traffic is probed continuously with new connections,
every sample timed (harness.probe). Also here: WaitForPolicy answering a
revision that changes nothing on the node at once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration
from harness.cni import check_result, cni, netconf
from harness.kube_api import POLICY_KINDS, k8s_policy
from harness.kube_cluster import KubeEnv, kube_cluster
from harness.pods import ENDPOINT
from harness.probe import Pod, Probe, probing, settle

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

A, B = 8080, 8081  # every server serves both; names pick one
# A pod's port change is enforced within WITHIN_S; a policy written to the
# API server within ENFORCED_S (its 1 s is test_k8s_policy's: here, with
# four probes at once on a shared machine, what counts is which ports).
WITHIN_S = 1.0
ENFORCED_S = 2.0
NS = "np"


Env = KubeEnv


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with kube_cluster(tmp_path_factory.mktemp("named-ports"), {NS: {}}) as env:
        yield env


def pod_object(name: str, labels: dict[str, str], ports: dict[str, int]) -> dict[str, Any]:
    container_ports = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": NS, "name": name, "labels": labels},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "main", "ports": [*container_ports, {"containerPort": 9}]}],
        },
    }


def _add(env: Env, name: str, conf: dict[str, Any]) -> Pod:
    ns = env.cluster.pod(env.node, f"np{name}")
    rc, result = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=(NS, name))
    assert rc == 0, result
    pod_cidrs = env.cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=env.node.name)).pod_cidrs
    cidr = next(c for c in pod_cidrs if ":" not in c)
    pod = Pod(name, ns, check_result(result, netns=ns.path, ifname="eth0", pod_cidr=cidr))
    for port in (A, B):
        ns.serve("tcp", port, name)
    return pod


def k8s_pod(env: Env, name: str, labels: dict[str, str], ports: dict[str, int]) -> Pod:
    """The Pod in the API server (ports named there), then its CNI ADD."""
    env.kube_api.apply("pods", pod_object(name, labels, ports))
    return _add(env, name, netconf(env.node.cni_socket, kubernetes=True))


def cni_args_pod(env: Env, name: str, labels: dict[str, str], ports: dict[str, int]) -> Pod:
    """Labels and named ports from the CNI arguments (no Pod read)."""
    conf = netconf(env.node.cni_socket, labels)
    conf["args"]["cni"]["namedPorts"] = [{"name": n, "port": p} for n, p in ports.items()]
    return _add(env, name, conf)


def delete_pod(env: Env, pod: Pod) -> None:
    conf = netconf(env.node.cni_socket, kubernetes=True)
    rc, out = cni("DEL", conf, container_id=f"ctr-{pod.name}", netns=pod.ns.path)
    assert rc == 0, out
    if env.kube_api.get("pods", NS, pod.name) is not None:
        env.kube_api.delete("pods", NS, pod.name)


@contextlib.contextmanager
def pods(env: Env, *made: Pod) -> Iterator[tuple[Pod, ...]]:
    try:
        yield made
    finally:
        for pod in made:
            delete_pod(env, pod)


@contextlib.contextmanager
def probes(pairs: dict[str, tuple[Pod, Pod]]) -> Iterator[dict[str, Probe]]:
    """Probes "<name>:<port>" from client to server on A and on B."""
    with probing(pairs, A) as on_a, probing(pairs, B) as on_b:
        yield {
            **{f"{k}:{A}": p for k, p in on_a.items()},
            **{f"{k}:{B}": p for k, p in on_b.items()},
        }


@contextlib.contextmanager
def network_policy(
    env: Env, name: str, spec: dict[str, Any], kind: str = "NetworkPolicy"
) -> Iterator[None]:
    resource, _ = POLICY_KINDS[kind]
    env.kube_api.apply(resource, k8s_policy(kind, NS, name, spec))
    try:
        yield
    finally:
        env.kube_api.delete(resource, NS, name)


def ingress_on(app: str, port: str) -> dict[str, Any]:
    """app's pods take connections on the named port only."""
    return {
        "podSelector": {"matchLabels": {"app": app}},
        "ingress": [{"ports": [{"port": port, "protocol": "TCP"}]}],
    }


def named_ports_of(env: Env, name: str) -> dict[str, int]:
    attachment = endpoint_pb2.Attachment(container_id=f"ctr-{name}", ifname="eth0")
    ep = env.cluster.endpoint().GetEndpoint(endpoint_pb2.GetEndpointRequest(attachment=attachment))
    return {p.name: p.port for p in ep.named_ports}


def test_a_networkpolicy_naming_a_port_on_the_stand_in_api_server_opens_each_pods_own_number(
    env: Env,
) -> None:
    with pods(
        env,
        k8s_pod(env, "client", {"app": "client"}, {}),
        k8s_pod(env, "srv-a", {"app": "srv"}, {"serve-tcp": A}),
        k8s_pod(env, "srv-b", {"app": "srv"}, {"serve-tcp": B}),
    ) as (client, srv_a, srv_b):
        # The endpoints carry their pods' named ports (the unnamed one not).
        assert named_ports_of(env, "srv-a") == {"serve-tcp": A}
        assert named_ports_of(env, "srv-b") == {"serve-tcp": B}
        with probes({"a": (client, srv_a), "b": (client, srv_b)}) as p:
            t0 = time.time()
            with network_policy(env, "srv", ingress_on("srv", "serve-tcp")):
                # Same labels, one identity: each pod its own number.
                want = {f"a:{A}": True, f"a:{B}": False, f"b:{A}": False, f"b:{B}": True}
                settle(p, t0, want, "named ingress", ENFORCED_S)
                t1 = time.time()
            settle(p, t1, dict.fromkeys(p, True), "policy deleted", ENFORCED_S)


def test_a_name_no_pod_gives_selects_no_port(env: Env) -> None:
    with (
        pods(
            env,
            k8s_pod(env, "client2", {"app": "client2"}, {}),
            k8s_pod(env, "srv-c", {"app": "srv-c"}, {"serve-tcp": A}),
        ) as (client, srv),
        probes({"c": (client, srv)}) as p,
    ):
        t0 = time.time()
        with network_policy(env, "srv-c", ingress_on("srv-c", "no-such-port")):
            settle(p, t0, {f"c:{A}": False, f"c:{B}": False}, "unknown name", ENFORCED_S)


def test_egress_naming_a_port_takes_the_peers_numbers(env: Env) -> None:
    with pods(
        env,
        k8s_pod(env, "client3", {"app": "client3"}, {}),
        k8s_pod(env, "db", {"app": "db"}, {"db-port": B}),
    ) as (client, db):
        spec = {
            "podSelector": {"matchLabels": {"app": "client3"}},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": {"app": "db"}}}],
                    "ports": [{"port": "db-port", "protocol": "TCP"}],
                }
            ],
        }
        with probes({"db": (client, db)}) as p:
            t0 = time.time()
            with network_policy(env, "client3", spec):
                settle(p, t0, {f"db:{A}": False, f"db:{B}": True}, "named egress", ENFORCED_S)


def test_a_deny_naming_a_port_beats_an_allow_of_every_port(env: Env) -> None:
    with pods(
        env,
        k8s_pod(env, "client6", {"app": "client6"}, {}),
        k8s_pod(env, "bystander", {"app": "bystander"}, {}),
        k8s_pod(env, "srv-f", {"app": "srv-f"}, {"web": A, "admin": B}),
    ) as (client, bystander, srv):
        spec = {
            "endpointSelector": {"matchLabels": {"app": "srv-f"}},
            "ingress": [{"fromEntities": ["all"]}],
            "ingressDeny": [
                {
                    "fromEndpoints": [{"matchLabels": {"app": "client6"}}],
                    "toPorts": [{"ports": [{"port": "admin", "protocol": "TCP"}]}],
                }
            ],
        }
        with probes({"c": (client, srv), "x": (bystander, srv)}) as p:
            t0 = time.time()
            with network_policy(env, "srv-f", spec, "CiliumNetworkPolicy"):
                want = {f"c:{A}": True, f"c:{B}": False, f"x:{A}": True, f"x:{B}": True}
                settle(p, t0, want, "named deny", ENFORCED_S)


def test_a_pod_changing_a_named_ports_number_on_the_stand_in_api_server_is_enforced_within_1s(
    env: Env,
) -> None:
    with pods(
        env,
        k8s_pod(env, "client4", {"app": "client4"}, {}),
        k8s_pod(env, "srv-d", {"app": "srv-d"}, {"serve-tcp": A}),
    ) as (client, srv):
        egress = {
            "podSelector": {"matchLabels": {"app": "client4"}},
            "policyTypes": ["Egress"],
            "egress": [{"ports": [{"port": "serve-tcp", "protocol": "TCP"}]}],
        }
        with (
            probes({"d": (client, srv)}) as p,
            network_policy(env, "srv-d", ingress_on("srv-d", "serve-tcp")),
            network_policy(env, "client4", egress),
        ):
            t0 = time.time()
            settle(p, t0, {f"d:{A}": True, f"d:{B}": False}, "before the change", ENFORCED_S)
            # The Pod's port gets another number: its ingress and the
            # client's egress (through the ipcache) follow.
            t1 = time.time()
            env.kube_api.apply("pods", pod_object("srv-d", {"app": "srv-d"}, {"serve-tcp": B}))
            settle(p, t1, {f"d:{A}": False, f"d:{B}": True}, "after the change", WITHIN_S)
            assert named_ports_of(env, "srv-d") == {"serve-tcp": B}


def test_named_ports_from_cni_arguments(env: Env) -> None:
    with pods(
        env,
        cni_args_pod(env, "client5", {"app": "client5"}, {}),
        cni_args_pod(env, "srv-e", {"app": "srv-e"}, {"web": B}),
    ) as (client, srv):
        assert named_ports_of(env, "srv-e") == {"web": B}
        with probes({"e": (client, srv)}) as p:
            t0 = time.time()
            with network_policy(env, "srv-e", ingress_on("srv-e", "web")):
                settle(p, t0, {f"e:{A}": False, f"e:{B}": True}, "named from CNI args", ENFORCED_S)


def test_a_malformed_named_port_in_cni_arguments_fails_the_add_naming_the_field(env: Env) -> None:
    conf = netconf(env.node.cni_socket, {"app": "bad"})
    conf["args"]["cni"]["namedPorts"] = [{"name": "Bad_Name", "port": 80}]
    ns = env.cluster.pod(env.node, "npbad")
    rc, result = cni("ADD", conf, container_id="ctr-bad", netns=ns.path, pod=(NS, "bad"))
    assert rc != 0
    assert "args.cni.namedPorts[0].name" in result["msg"] + result.get("details", "")


def test_wait_for_policy_answers_a_revision_that_changes_nothing_here_within_100ms(
    env: Env,
) -> None:
    with pods(env, k8s_pod(env, "idle", {"app": "idle"}, {})) as (_idle,):
        attachment = endpoint_pb2.Attachment(container_id="ctr-idle", ifname="eth0")
        ep = env.cluster.endpoint().GetEndpoint(
            endpoint_pb2.GetEndpointRequest(attachment=attachment)
        )
        datapath = env.cluster.datapath(env.node, as_=ENDPOINT)
        policy = env.cluster.policy()
        doc = (
            "apiVersion: flagella.io/v1\nkind: FlagellaNetworkPolicy\n"
            "metadata: {name: nobody-here, namespace: elsewhere}\n"
            "spec: {endpointSelector: {matchLabels: {app: none}}, ingress: [{}]}\n"
        )
        try:
            for _ in range(3):
                put = policy.PutRules(policy_pb2.PutRulesRequest(document=doc), timeout=10)
                t0 = time.monotonic()
                got = datapath.WaitForPolicy(
                    datapath_pb2.WaitForPolicyRequest(
                        endpoint_id=ep.id,
                        min_revision=put.revision,
                        timeout=Duration(seconds=5),
                    ),
                    timeout=10,
                )
                took = time.monotonic() - t0
                assert got.realized_revision >= put.revision
                assert took < 0.1, f"WaitForPolicy took {took * 1000:.0f} ms"
        finally:
            policy.DeleteRule(policy_pb2.DeleteRuleRequest(name="elsewhere/nobody-here"))
