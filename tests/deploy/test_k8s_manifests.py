"""The Kubernetes manifests, offline (no API server can run here): the base
and every overlay build with `kubectl kustomize`, the output passes
`kubernetes-validate --strict`, and the rules the design sets hold for every
object: only the datapath has capabilities or host access, everything else
is non-root with no capabilities and a read-only root; RBAC reads what each
service watches and lets it write only its Events and Leases (and the
endpoint service its FlagellaEndpoints), certgen only Secrets in the
namespace (plus the one Role it keeps and listing Nodes); every flagella
workload mounts its own certificate and none runs --insecure; etcd serves
TLS with client certificates, each service mounts its own etcd Secret and
only the etcd-auth Job root's; the cert-manager overlay's Certificates name
the right identities; the policy
CRDs are structural and take the policies flagella documents; the
FlagellaEndpoint CRD takes the objects the endpoint service writes and
shows them with printer columns."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (kubernetes-validate brings it)
import pytest
import yaml
from harness.prometheus import documented_ports

from flagella.cli.targets import LOCAL_PORTS, default_address
from flagella.cli.targets import SERVICES as CLI_SERVICES
from flagella.common.config import load_config
from flagella.datapath.config import ROUTING_MODES, DatapathConfig
from flagella.endpoint import flagellaendpoint
from flagella.endpoint.kube import LEASE_NAME as ENDPOINT_LEASE
from flagella.endpoint.labels import PodInfo
from flagella.endpoint.model import Endpoint, State
from flagella.lb.k8s import LEASE_NAME as LB_LEASE
from flagella.policy.kube import ADMIN_GROUP
from flagella.policy.kube import KINDS as POLICY_KINDS

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PROMETHEUS_K8S = ROOT / "deploy" / "prometheus" / "prometheus-kubernetes.yml"
# Overlays that only add objects to the base are checked as the base plus
# what they add (every check of the base holds for them as it is).
ADD_ONLY = {"k8s/overlays/prometheus-operator"}
TARGETS = [
    "k8s",
    *sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "k8s/overlays").iterdir()
        if str(p.relative_to(ROOT)) not in ADD_ONLY
    ),
]
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "ReplicaSet", "Pod"}
# NET_BIND_SERVICE and SETPCAP: the BGP speaker (gobgpd binds 179 with that alone).
DATAPATH_CAPS = {"NET_ADMIN", "SYS_ADMIN", "BPF", "PERFMON", "NET_BIND_SERVICE", "SETPCAP"}
READ_VERBS = {"get", "list", "watch"}
POLICY_READS = {(k.group, k.plural) for k in POLICY_KINDS}
POLICY_LEASES = tuple(sorted(k.lease for k in POLICY_KINDS))
# What each account may read, anywhere (get/list/watch).
READS = {
    "flagella-ipam": {("", "nodes")},
    "flagella-policy": POLICY_READS,
    "flagella-endpoint": {
        ("", "pods"),
        ("", "namespaces"),
        (flagellaendpoint.GROUP, flagellaendpoint.PLURAL),
    },
    "flagella-lb": {
        ("", "services"),
        ("discovery.k8s.io", "endpointslices"),
        ("cilium.io", "ciliumlocalredirectpolicies"),
        ("cilium.io", "ciliumloadbalancerippools"),
        ("cilium.io", "ciliumbgppeeringpolicies"),
    },
    # Which nodes need a certificate, with their addresses.
    "flagella-certgen": {("", "nodes")},
    # Nothing as shipped: certgen names the node Secrets in its Role (see
    # test_certgen_issues_every_identity_and_the_datapath_role_starts_empty).
    "flagella-datapath": set(),
}
ETCD_SERVER_SECRET = "flagella-etcd-server-tls"
ETCD_ROOT_SECRET = "flagella-etcd-root-tls"
ETCD_AUTH_JOB = "flagella-etcd-auth"
# The verbs of those reads, where not all of get/list/watch.
READ_VERBS_OF = {"flagella-certgen": {"list"}}
# Everything else each account may do: (group, resource, verb, namespace or
# "" for every namespace, the resource names it is limited to or ()).
LEASES = "coordination.k8s.io"
RBAC = "rbac.authorization.k8s.io"
FE_WRITES = ("create", "update", "delete")
NODE_CERTS_ROLE = "flagella-datapath-node-certs"
SERVICES = ("ipam", "policy", "endpoint", "lb")
# Those with a certificate of their own: the four and the flow relay (which
# has no etcd user).
TLS_SERVICES = (*SERVICES, "relay")
OTHER = {
    # AnnotateNode: the node's CIDR and health annotations (docs/ipam.md).
    "flagella-ipam": {("", "nodes", "patch", "", ())},
    "flagella-endpoint": {
        *((flagellaendpoint.GROUP, flagellaendpoint.PLURAL, v, "", ()) for v in FE_WRITES),
        ("", "events", "create", "", ()),
        (LEASES, "leases", "create", "flagella", ()),
        (LEASES, "leases", "get", "flagella", (ENDPOINT_LEASE,)),
        (LEASES, "leases", "update", "flagella", (ENDPOINT_LEASE,)),
    },
    "flagella-policy": {
        ("", "events", "create", "", ()),
        (LEASES, "leases", "create", "flagella", ()),
        (LEASES, "leases", "get", "flagella", POLICY_LEASES),
        (LEASES, "leases", "update", "flagella", POLICY_LEASES),
    },
    "flagella-lb": {
        # LB-IPAM's write-back: LoadBalancer addresses, pool conditions.
        ("", "services/status", "patch", "", ()),
        ("cilium.io", "ciliumloadbalancerippools/status", "patch", "", ()),
        (LEASES, "leases", "create", "flagella", ()),
        (LEASES, "leases", "get", "flagella", (LB_LEASE,)),
        (LEASES, "leases", "update", "flagella", (LB_LEASE,)),
        # BGP neighbours' passwords: the Secrets its Role names, nothing else.
        ("", "secrets", "get", "flagella", ("flagella-bgp-password",)),
    },
    # Secrets of its own namespace only (no list, no delete, nowhere else),
    # and the datapath's node-cert Role, which it keeps to the node Secrets.
    "flagella-certgen": {
        *(("", "secrets", v, "flagella", ()) for v in ("get", "create", "update")),
        *((RBAC, "roles", v, "flagella", (NODE_CERTS_ROLE,)) for v in ("get", "update")),
    },
    "flagella-datapath": set(),
}
# What each account may write at all: (group, resource).
WRITES = {
    "flagella-ipam": {("", "nodes")},
    "flagella-policy": {("", "events"), (LEASES, "leases")},
    "flagella-endpoint": {
        ("", "events"),
        (LEASES, "leases"),
        (flagellaendpoint.GROUP, flagellaendpoint.PLURAL),
    },
    "flagella-lb": {
        (LEASES, "leases"),
        ("", "services/status"),
        ("cilium.io", "ciliumloadbalancerippools/status"),
    },
    "flagella-certgen": {("", "secrets"), (RBAC, "roles")},
    "flagella-datapath": set(),
}
CLUSTER_SCOPED = ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition")
# Service link variables Kubernetes sets in every pod of the namespace.
SERVICE_LINK = re.compile(r"^[A-Z0-9_]+_SERVICE_(HOST|PORT(_[A-Z0-9_]+)?)$")


def kubectl() -> str:
    path = shutil.which("kubectl", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail("kubectl is missing: scripts/setup installs it")
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`kubectl kustomize` of the base and each overlay, once per module."""
    out_dir = tmp_path_factory.mktemp("k8s")
    files = {}
    for target in TARGETS:
        res = subprocess.run(
            [kubectl(), "kustomize", str(ROOT / target)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert res.returncode == 0, f"kubectl kustomize {target}:\n{res.stderr}"
        path = out_dir / (target.replace("/", "_") + ".yaml")
        path.write_text(res.stdout)
        files[target] = path
    return files


def objects(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Pod":
        return dict(obj["spec"])
    if obj["kind"] == "CronJob":
        return dict(obj["spec"]["jobTemplate"]["spec"]["template"]["spec"])
    return dict(obj["spec"]["template"]["spec"])


def workloads(path: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj in objects(path):
        if obj["kind"] in WORKLOADS:
            yield obj, pod_spec(obj)


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def is_datapath(obj: dict[str, Any]) -> bool:
    return bool(obj["kind"] == "DaemonSet" and obj["metadata"]["name"] == "datapath")


@pytest.mark.parametrize("target", TARGETS)
def test_kustomize_builds_and_validates_strictly(rendered: dict[str, Path], target: str) -> None:
    res = subprocess.run(
        [str(VENV_BIN / "kubernetes-validate"), "--strict", "--quiet", str(rendered[target])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    kinds = {o["kind"] for o in objects(rendered[target])}
    assert {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Service",
        "Deployment",
        "StatefulSet",
        "DaemonSet",
        "PodDisruptionBudget",
    } <= kinds
    assert all(
        o["metadata"].get("namespace") == "flagella"
        for o in objects(rendered[target])
        if o["kind"] not in CLUSTER_SCOPED
    )


@pytest.mark.parametrize("target", TARGETS)
def test_only_the_datapath_has_capabilities_or_host_access(
    rendered: dict[str, Path], target: str
) -> None:
    seen_datapath = False
    for obj, spec in workloads(rendered[target]):
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        assert spec.get("securityContext", {}).get("seccompProfile") == {
            "type": "RuntimeDefault"
        }, name
        if is_datapath(obj):
            seen_datapath = True
            assert spec["hostNetwork"] is True
            assert not spec.get("hostPID")
            assert not spec.get("hostIPC")
            for c in all_containers(spec):
                sc = c["securityContext"]
                assert sc.get("privileged") is not True, c["name"]
                assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
                assert set(sc["capabilities"].get("add", [])) <= DATAPATH_CAPS, c["name"]
                assert sc["readOnlyRootFilesystem"] is True, c["name"]
            main = next(c for c in spec["containers"] if c["name"] == "datapath")
            assert set(main["securityContext"]["capabilities"]["add"]) == DATAPATH_CAPS
            for init in spec.get("initContainers", []):
                assert not init["securityContext"]["capabilities"].get("add"), init["name"]
                assert init["securityContext"]["allowPrivilegeEscalation"] is False
            continue
        # Everything else: no host namespaces or folders, non-root, no
        # capabilities, no privilege escalation, read-only root.
        assert not spec.get("hostNetwork"), name
        assert not spec.get("hostPID"), name
        assert not spec.get("hostIPC"), name
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], name
        pod_sc = spec.get("securityContext", {})
        for c in all_containers(spec):
            sc = c.get("securityContext", {})
            where = f"{name} container {c['name']}"
            assert sc.get("privileged") is not True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, where
            assert not any("hostPort" in p for p in c.get("ports", [])), where
    assert seen_datapath


def permissions(
    objs: list[dict[str, Any]],
) -> dict[str, set[tuple[str, str, str, str, tuple[str, ...]]]]:
    """What each ServiceAccount may do through its bindings: (group,
    resource, verb, namespace or "" for all, resource names or ())."""
    roles = {
        (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace", "")): o
        for o in objs
        if o["kind"] in ("Role", "ClusterRole")
    }
    out: dict[str, set[tuple[str, str, str, str, tuple[str, ...]]]] = {}
    for b in (o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        # A RoleBinding grants in its namespace, whatever role it names.
        scope = b["metadata"].get("namespace", "") if b["kind"] == "RoleBinding" else ""
        ref = b["roleRef"]
        role = roles[
            (
                ref["kind"],
                ref["name"],
                b["metadata"].get("namespace", "") if ref["kind"] == "Role" else "",
            )
        ]
        for subject in b["subjects"]:
            assert subject["kind"] == "ServiceAccount"
            assert subject["namespace"] == "flagella"
            granted = out.setdefault(subject["name"], set())
            for rule in role["rules"]:
                assert "nonResourceURLs" not in rule
                names = tuple(sorted(rule.get("resourceNames", ())))
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            granted.add((group, resource, verb, scope, names))
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_rbac_reads_what_flagella_watches_and_writes_only_events_and_leases(
    rendered: dict[str, Path], target: str
) -> None:
    """Each account reads exactly what its service watches; policy can
    write only Events (create) and its own Leases, endpoint only
    FlagellaEndpoints, Events (create) and its own Lease, lb only its own
    Lease, the others nothing at all; no wildcards."""
    objs = objects(rendered[target])
    granted = permissions(objs)
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    assert set(granted) <= accounts
    assert set(granted) == set(READS)
    for account, perms in granted.items():
        for group, resource, verb, _, _ in perms:
            assert "*" not in (group, resource, verb), (account, group, resource, verb)
        reads = {
            (g, r, v) for g, r, v, ns, names in perms if not ns and not names and v in READ_VERBS
        }
        verbs = READ_VERBS_OF.get(account, READ_VERBS)
        assert reads == {(g, r, v) for g, r in READS[account] for v in verbs}, account
        rest = {p for p in perms if (p[0], p[1], p[2]) not in reads or p[3] or p[4]}
        assert rest == OTHER[account], account
        writes = {(g, r) for g, r, v, _, _ in rest if v not in READ_VERBS}
        assert writes <= WRITES[account], account
    # Pods that read nothing from the API carry no token.
    for obj, spec in workloads(rendered[target]):
        if spec["serviceAccountName"] not in granted:
            assert spec.get("automountServiceAccountToken") is False, obj["metadata"]["name"]


def _structural(node: dict[str, Any], path: str) -> None:
    """Every node has a type (or is int-or-string), as the API server
    requires of a CRD schema."""
    if not node.get("x-kubernetes-int-or-string"):
        assert "type" in node, path
    for name, child in (node.get("properties") or {}).items():
        _structural(child, f"{path}.{name}")
    if "items" in node:
        _structural(node["items"], f"{path}[]")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        _structural(extra, f"{path}{{}}")


def _crds_by_kind(rendered: dict[str, Path]) -> dict[str, dict[str, Any]]:
    return {
        o["spec"]["names"]["kind"]: o
        for o in objects(rendered["k8s"])
        if o["kind"] == "CustomResourceDefinition"
    }


def _documented(kinds: Collection[str]) -> list[dict[str, Any]]:
    """The example objects of these kinds in docs/policy.md."""
    return [
        d
        for text in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs/policy.md").read_text(), re.S)
        for d in yaml.safe_load_all(text)
        if isinstance(d, dict) and d.get("kind") in kinds
    ]


def test_policy_crds_are_structural_have_printer_columns_and_take_the_documented_policies(
    rendered: dict[str, Path],
) -> None:
    crds = _crds_by_kind(rendered)
    # Upstream's kinds (NetworkPolicy; the admin tiers' CRDs are upstream's
    # shape, tested below).
    # (CiliumCIDRGroup is no policy: tested below.)
    kinds = {
        k.kind: k
        for k in POLICY_KINDS
        if k.group not in ("networking.k8s.io", ADMIN_GROUP) and not k.cidr_groups
    }
    others = {k.kind for k in POLICY_KINDS if k.group == ADMIN_GROUP or k.cidr_groups}
    assert set(crds) == {*kinds, *others, flagellaendpoint.KIND, LRP_KIND, POOL_KIND, BGP_KIND}
    crds.pop(flagellaendpoint.KIND)
    crds.pop(LRP_KIND)  # the lb's, tested below
    crds.pop(POOL_KIND)
    crds.pop(BGP_KIND)
    for kind in others:
        crds.pop(kind)
    docs = _documented(kinds)
    assert docs, "docs/policy.md has no example policy"
    for kind, crd in crds.items():
        spec = crd["spec"]
        k = kinds[kind]
        assert crd["metadata"]["name"] == f"{k.plural}.{k.group}"
        assert (spec["group"], spec["names"]["plural"]) == (k.group, k.plural)
        cluster_wide = kind == "CiliumClusterwideNetworkPolicy"
        assert spec["scope"] == ("Cluster" if cluster_wide else "Namespaced")
        [version] = spec["versions"]
        assert version["name"] == k.version
        schema = version["schema"]["openAPIV3Schema"]
        _structural(schema, kind)
        columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
        assert columns["Age"] == ".metadata.creationTimestamp"
        assert columns["Selector"] == ".spec.endpointSelector.matchLabels"
        for doc in docs:
            jsonschema.validate(
                {**doc, "apiVersion": f"{k.group}/{k.version}", "kind": kind}, schema
            )
        # What flagella does not support is kept for it to report, not dropped.
        l7 = {"endpointSelector": {}, "egress": [{"toFQDNs": [{"matchName": "x"}]}]}
        jsonschema.validate({"spec": l7}, schema)
        assert schema["properties"]["spec"]["properties"]["egress"]["items"][
            "x-kubernetes-preserve-unknown-fields"
        ]
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"spec": {"endpointSelector": {"matchLabels": {"a": 1}}}}, schema)


def test_the_cilium_cidr_group_crd_is_cluster_scoped_and_takes_a_list_of_cidrs(
    rendered: dict[str, Path],
) -> None:
    groups = [k for k in POLICY_KINDS if k.cidr_groups]
    assert [k.kind for k in groups] == ["CiliumCIDRGroup"]
    [k] = groups
    crd = _crds_by_kind(rendered)[k.kind]
    assert crd["metadata"]["name"] == f"{k.plural}.{k.group}"
    assert crd["spec"]["scope"] == "Cluster"
    [version] = crd["spec"]["versions"]
    assert version["name"] == k.version
    schema = version["schema"]["openAPIV3Schema"]
    _structural(schema, k.kind)
    jsonschema.validate({"spec": {"externalCIDRs": ["192.0.2.0/24", "2001:db8::/64"]}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"spec": {"externalCIDRs": "192.0.2.0/24"}}, schema)


def test_admin_network_policy_crds_are_structural_and_take_the_documented_policies(
    rendered: dict[str, Path],
) -> None:
    kinds = {k.kind: k for k in POLICY_KINDS if k.group == ADMIN_GROUP}
    crds = {k: v for k, v in _crds_by_kind(rendered).items() if k in kinds}
    assert set(crds) == set(kinds)
    docs = _documented(kinds)
    assert {d["kind"] for d in docs} == set(kinds), "docs/policy.md lacks an example"
    for kind, crd in crds.items():
        k = kinds[kind]
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{k.plural}.{k.group}"
        assert (spec["names"]["plural"], spec["scope"]) == (k.plural, "Cluster")
        [version] = spec["versions"]
        assert version["name"] == k.version
        schema = version["schema"]["openAPIV3Schema"]
        _structural(schema, kind)
        for doc in docs:
            if doc["kind"] == kind:
                jsonschema.validate(doc, schema)
        ingress = schema["properties"]["spec"]["properties"]["ingress"]["items"]
        assert ("Pass" in ingress["properties"]["action"]["enum"]) is (kind == "AdminNetworkPolicy")
    priority = crds["AdminNetworkPolicy"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {"metadata": {}, "spec": {"priority": 1001, "subject": {"namespaces": {}}}}, priority
        )


def test_the_flagellaendpoint_crd_takes_what_the_endpoint_service_writes_with_printer_columns(
    rendered: dict[str, Path],
) -> None:
    [crd] = [
        o
        for o in objects(rendered["k8s"])
        if o["kind"] == "CustomResourceDefinition"
        and o["spec"]["names"]["kind"] == flagellaendpoint.KIND
    ]
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{flagellaendpoint.PLURAL}.{flagellaendpoint.GROUP}"
    assert (spec["group"], spec["names"]["plural"], spec["scope"]) == (
        flagellaendpoint.GROUP,
        flagellaendpoint.PLURAL,
        "Namespaced",
    )
    [version] = spec["versions"]
    assert version["name"] == flagellaendpoint.VERSION
    schema = version["schema"]["openAPIV3Schema"]
    _structural(schema, flagellaendpoint.KIND)
    # kubectl get flagellaendpoints -A: identity, state, node, IPs.
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Identity"] == ".status.identity.id"
    assert columns["State"] == ".status.state"
    assert columns["Node"] == ".status.node"
    assert columns["IPv4"] == ".status.networking.addressing[0].ipv4"
    assert columns["IPv6"] == ".status.networking.addressing[0].ipv6"
    pod = PodInfo("shop", "web-0", "0b6c-uid", labels={"app": "web"})
    for state in State:
        eps = [
            Endpoint(
                id=7, container_id="c1", ifname=ifname, netns_path="/run/netns/x", node="n1",
                pod_name="web-0", pod_namespace="shop", labels={"app": "web"}, identity=300,
                addresses=[f"10.0.0.{i + 5}/32", f"fd00::{i + 5}/128"], state=state,
                policy_revision=4,
            )
            for i, ifname in enumerate(("eth0", "net1"))
        ]  # fmt: skip
        obj = flagellaendpoint.desired(pod, eps)
        assert obj is not None
        jsonschema.validate(obj, schema)
        # Every field the service writes is in the schema: the API server
        # would prune anything else.
        _all_declared(obj["status"], schema["properties"]["status"], "status")
        [owner] = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"]) == ("Pod", pod.uid)


def _all_declared(value: Any, node: dict[str, Any], path: str) -> None:
    if isinstance(value, dict):
        for key, child in value.items():
            assert key in node.get("properties", {}), f"{path}.{key} is not in the schema"
            _all_declared(child, node["properties"][key], f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            _all_declared(item, node["items"], f"{path}[]")


@pytest.mark.parametrize("target", TARGETS)
def test_services_have_grpc_probes_resources_and_disruption_budgets(
    rendered: dict[str, Path], target: str
) -> None:
    objs = objects(rendered[target])
    pdbs = {
        tuple(sorted(o["spec"]["selector"]["matchLabels"].items()))
        for o in objs
        if o["kind"] == "PodDisruptionBudget"
    }
    flagella = {"ipam", "policy", "endpoint", "lb", "datapath"}
    for obj, spec in workloads(rendered[target]):
        name = obj["metadata"]["name"]
        for c in all_containers(spec):
            assert c["resources"]["requests"]["memory"], (name, c["name"])
            assert c["resources"]["limits"]["memory"], (name, c["name"])
        for c in spec["containers"]:
            if name in flagella:
                # The plaintext health-only port: the kubelet's gRPC probe
                # cannot present a certificate (docs/SECURITY.md).
                [port] = [p["containerPort"] for p in c["ports"] if p["name"] == "health"]
                env = {e["name"]: e.get("value", "") for e in c["env"]}
                assert env[f"FLAGELLA_{name.upper()}_HEALTH_LISTEN"].endswith(f":{port}"), name
                assert c["readinessProbe"]["grpc"]["port"] == port, name
                assert c["livenessProbe"]["grpc"]["port"] == port, name
            elif obj["kind"] not in ("Job", "CronJob"):  # a run to completion has no probes
                assert c["readinessProbe"], name
                assert c["livenessProbe"], name
        if obj["kind"] in ("Deployment", "StatefulSet") and name != "jaeger":
            key = tuple(sorted(obj["spec"]["selector"]["matchLabels"].items()))
            assert key in pdbs, f"no PodDisruptionBudget for {name}"


@pytest.mark.parametrize("target", TARGETS)
def test_env_references_are_defined_before_use(rendered: dict[str, Path], target: str) -> None:
    """$(VAR) in an env value expands only from variables defined earlier in
    the same container (or the Service link variables); anything else stays
    literal and breaks the address it was part of."""
    objs = objects(rendered[target])
    service_ports = {
        o["metadata"]["name"]: {p.get("name") for p in o["spec"]["ports"]}
        for o in objs
        if o["kind"] == "Service"
    }
    for obj, spec in workloads(rendered[target]):
        for c in all_containers(spec):
            defined: set[str] = set()
            for var in c.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z0-9_]+)\)", var.get("value", "")):
                    if SERVICE_LINK.match(ref):
                        svc = ref.split("_SERVICE_")[0].lower().replace("_", "-")
                        assert svc in service_ports, (c["name"], ref)
                        port = ref.split("_SERVICE_PORT_")[-1].lower().replace("_", "-")
                        if "_SERVICE_PORT_" in ref:
                            assert port in service_ports[svc], (c["name"], ref)
                    else:
                        assert ref in defined, (obj["metadata"]["name"], c["name"], ref)
                defined.add(var["name"])


def test_replicas_and_etcd_membership(rendered: dict[str, Path]) -> None:
    """Base: 2 replicas of each service, a 3-member etcd; the dev overlay: 1 of
    everything. etcd's initial cluster always lists exactly its members."""
    for target, service_replicas, etcd_replicas in (("k8s", 2, 3), ("k8s/overlays/dev", 1, 1)):
        objs = objects(rendered[target])
        deployments = {
            o["metadata"]["name"]: o["spec"]["replicas"] for o in objs if o["kind"] == "Deployment"
        }
        for svc in ("ipam", "policy", "endpoint", "lb"):
            assert deployments[svc] == service_replicas, (target, svc)
        etcd = next(o for o in objs if o["kind"] == "StatefulSet")
        assert etcd["spec"]["replicas"] == etcd_replicas
        assert etcd["spec"]["volumeClaimTemplates"]
        env = {
            e["name"]: e.get("value")
            for e in etcd["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        members = env["ETCD_INITIAL_CLUSTER"].split(",")
        assert members == [
            f"etcd-{i}=http://etcd-{i}.{etcd['spec']['serviceName']}:2380"
            for i in range(etcd_replicas)
        ]


def test_cni_conflist_carries_what_the_plugin_reads(rendered: dict[str, Path]) -> None:
    """The init container installs flagella-cni with a conflist whose plugin
    entry the CNI parser (in the endpoint service) accepts: type, socket,
    mtu, labels from the API server, and no address or node (the plugin talks only to its node's
    datapath, which serves that socket from the node's /run/flagella)."""
    from flagella.endpoint import cni

    script = (ROOT / "docker/datapath/install-cni.sh").read_text()
    body = script.split("<<JSON\n", 1)[1].split("\nJSON\n", 1)[0]
    conflist = (
        body.replace("$socket", "/run/flagella/cni.sock")
        .replace("$mtu", "1500")
        .replace("$kubernetes", "true")
    )
    parsed = json.loads(conflist)
    (plugin,) = parsed["plugins"]
    assert set(plugin) == {"type", "socket", "mtu", "kubernetes"}
    # The runtime hands the plugin its entry with the list's name and version.
    conf = cni.parse_netconf(
        json.dumps({"cniVersion": parsed["cniVersion"], "name": parsed["name"], **plugin}).encode(),
        "DEL",
    )
    assert (conf.type, conf.raw["socket"], conf.mtu, conf.resolve_labels_from_kubernetes) == (
        "flagella-cni",
        "/run/flagella/cni.sock",
        1500,
        True,
    )
    datapath = next(o for o in objects(rendered["k8s"]) if is_datapath(o))
    init = pod_spec(datapath)["initContainers"][0]
    env = {e["name"]: e for e in init["env"]}
    assert env["FLAGELLA_CNI_SOCKET"]["value"] == "/run/flagella/cni.sock"
    main = pod_spec(datapath)["containers"][0]
    main_env = {e["name"]: e.get("value") for e in main["env"]}
    assert main_env["FLAGELLA_DATAPATH_CNI_SOCKET"] == "/run/flagella/cni.sock"
    assert main_env["FLAGELLA_DATAPATH_ENDPOINT_ADDRESS"] == "endpoint:50053"
    volumes = {v["name"]: v for v in pod_spec(datapath)["volumes"]}
    (socket_mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == "/run/flagella"]
    assert volumes[socket_mount["name"]]["hostPath"]["path"] == "/run/flagella"
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {"/host/opt/cni/bin", "/host/etc/cni/net.d"}


def volume_of(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    [mount] = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return dict(volume)


@pytest.mark.parametrize("target", TARGETS)
def test_every_flagella_workload_mounts_its_own_certificate_and_none_is_insecure(
    rendered: dict[str, Path], target: str
) -> None:
    """Each service mounts exactly its own Secret at /etc/flagella/tls; the
    datapath gets its node's from the Secret flagella-node-<node> through its
    node-cert containers (the only ones with an API token); no
    FLAGELLA_INSECURE or --insecure anywhere."""
    objs = objects(rendered[target])
    for obj in objs:
        if obj["kind"] == "ConfigMap":
            assert not [k for k in obj.get("data", {}) if re.match(r"FLAGELLA_(\w+_)?INSECURE$", k)]
    mounted: dict[str, str] = {}
    seen = set()
    for obj, spec in workloads(rendered[target]):
        name = obj["metadata"]["name"]
        for c in all_containers(spec):
            assert not [
                e for e in c.get("env", []) if re.match(r"FLAGELLA_(\w+_)?INSECURE$", e["name"])
            ]
            assert "--insecure" not in [*c.get("command", []), *c.get("args", [])], name
            for v in spec.get("volumes", []):
                if "secret" in v and any(m["name"] == v["name"] for m in c.get("volumeMounts", [])):
                    mounted.setdefault(v["secret"]["secretName"], f"{name}/{c['name']}")
        if name in TLS_SERVICES:
            seen.add(name)
            [main] = spec["containers"]
            volume = volume_of(spec, main, "/etc/flagella/tls")
            assert volume["secret"]["secretName"] == f"flagella-service-{name}", name
            # Readable by the service's group only (the pod's fsGroup).
            assert volume["secret"]["defaultMode"] == 0o440
            assert spec["securityContext"]["fsGroup"] == main.get("securityContext", {}).get(
                "runAsGroup", spec["securityContext"]["runAsGroup"]
            )
        if is_datapath(obj):
            seen.add(name)
            assert spec["automountServiceAccountToken"] is False
            main = next(c for c in spec["containers"] if c["name"] == "datapath")
            tls = volume_of(spec, main, "/etc/flagella/tls")
            assert tls["emptyDir"]["medium"] == "Memory"
            assert next(m for m in main["volumeMounts"] if m["name"] == tls["name"])["readOnly"]
            token_path = "/var/run/secrets/kubernetes.io/serviceaccount"
            fetchers = [c for c in spec["initContainers"] if c["name"].startswith("node-cert")]
            # One fetch before the datapath starts, one sidecar that renews.
            assert [c.get("restartPolicy") for c in fetchers] == [None, "Always"]
            for c in fetchers:
                assert volume_of(spec, c, "/etc/flagella/tls") == tls
                assert "serviceAccountToken" in str(volume_of(spec, c, token_path))
                assert c["command"][1:3] == ["certs", "k8s-fetch"]
                assert "--secret=flagella-node-$(NODE_NAME)" in c["command"]
                env = {e["name"]: e for e in c["env"]}
                assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
            for c in all_containers(spec):
                if c not in fetchers:
                    paths = {m["mountPath"] for m in c.get("volumeMounts", [])}
                    assert token_path not in paths, c["name"]
    assert seen == {*TLS_SERVICES, "datapath"}
    # Nobody mounts another's Secret, nor the CA's; etcd's Secrets: see
    # test_etcd_serves_tls_and_each_workload_mounts_its_own_etcd_secret.
    assert mounted == {
        **{f"flagella-service-{s}": f"{s}/{s}" for s in TLS_SERVICES},
        # First mounted by the init container waiting for etcd's auth.
        **{f"flagella-{s}-etcd-tls": f"{s}/etcd-auth-wait" for s in SERVICES},
        ETCD_SERVER_SECRET: "etcd/etcd",
        ETCD_ROOT_SECRET: f"{ETCD_AUTH_JOB}/etcd-auth",
    }


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("target", TARGETS)
def test_etcd_serves_tls_and_each_workload_mounts_its_own_etcd_secret(
    rendered: dict[str, Path], target: str
) -> None:
    """etcd serves clients over TLS only and wants a client certificate
    (--client-cert-auth) from the CA in its Secret; its probe reads /health
    on the plaintext metrics port. Each service mounts its own etcd Secret
    (CN = its etcd user) at /etc/flagella/etcd-tls and no other; the
    datapath none; root's only the flagella-etcd-auth Job, which runs
    `flagella etcd-auth apply` with it and reads nothing from the API."""
    objs = objects(rendered[target])
    [etcd] = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd"]
    spec = pod_spec(etcd)
    [main] = spec["containers"]
    env = env_of(main)
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true"
    assert env["ETCD_LISTEN_CLIENT_URLS"] == "https://0.0.0.0:2379"
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == "https://$(POD_NAME).etcd-peer:2379"
    assert env["ETCD_LISTEN_METRICS_URLS"] == "http://0.0.0.0:2381"
    folder = "/etc/etcd/tls"
    assert (env["ETCD_CERT_FILE"], env["ETCD_KEY_FILE"], env["ETCD_TRUSTED_CA_FILE"]) == (
        f"{folder}/tls.crt",
        f"{folder}/tls.key",
        f"{folder}/ca.crt",
    )
    assert volume_of(spec, main, folder)["secret"]["secretName"] == ETCD_SERVER_SECRET
    probe = main["readinessProbe"]["httpGet"]
    [metrics] = [p for p in main["ports"] if p["name"] == probe["port"]]
    assert (probe["path"], metrics["containerPort"]) == ("/health", 2381)
    for key, value in env.items():
        if key.startswith("ETCD_") and key.endswith("_URLS") and "CLIENT" in key:
            assert value.startswith("https://"), key

    etcd_secrets: dict[str, set[str]] = {}
    for obj, pod in workloads(rendered[target]):
        name = obj["metadata"]["name"]
        for v in pod.get("volumes", []):
            secret = v.get("secret", {}).get("secretName", "")
            if "etcd" in secret:
                etcd_secrets.setdefault(name, set()).add(secret)
        if name in SERVICES:
            [c] = pod["containers"]
            volume = volume_of(pod, c, "/etc/flagella/etcd-tls")
            assert volume["secret"] == {
                "secretName": f"flagella-{name}-etcd-tls",
                "defaultMode": 0o440,
            }, name
            # The defaults of --etcd-cert/--etcd-key/--etcd-ca: no override.
            assert not [k for k in env_of(c) if k.startswith(f"FLAGELLA_{name.upper()}_ETCD_")]
            # It starts once etcd enforces the roles, asked with its own
            # etcd certificate (the init container mounts nothing else).
            [init] = pod["initContainers"]
            assert init["command"][1:3] == ["etcd-auth", "wait"]
            assert "--etcd-tls-dir=/etc/flagella/etcd-tls" in init["command"]
            assert [m["mountPath"] for m in init["volumeMounts"]] == ["/etc/flagella/etcd-tls"]
            assert volume_of(pod, init, "/etc/flagella/etcd-tls") == volume
    assert etcd_secrets == {
        **{s: {f"flagella-{s}-etcd-tls"} for s in SERVICES},
        "etcd": {ETCD_SERVER_SECRET},
        ETCD_AUTH_JOB: {ETCD_ROOT_SECRET},
    }

    [job] = [o for o in objs if o["kind"] == "Job" and o["metadata"]["name"] == ETCD_AUTH_JOB]
    job_spec = pod_spec(job)
    [c] = job_spec["containers"]
    assert c["command"] == [
        "/opt/flagella/bin/flagella",
        "etcd-auth",
        "apply",
        "--etcd-endpoints=etcd:2379",
        "--etcd-tls-dir=/etc/flagella/etcd-tls",
    ]
    assert volume_of(job_spec, c, "/etc/flagella/etcd-tls")["secret"]["secretName"] == (
        ETCD_ROOT_SECRET
    )
    assert job_spec["automountServiceAccountToken"] is False


def certgen_commands(objs: list[dict[str, Any]]) -> list[list[str]]:
    return [
        pod_spec(o)["containers"][0]["command"]
        for o in objs
        if o["kind"] in ("Job", "CronJob") and o["metadata"]["name"] == "flagella-certgen"
    ]


@pytest.mark.parametrize("target", TARGETS)
def test_certgen_issues_every_identity_and_the_datapath_role_starts_empty(
    rendered: dict[str, Path], target: str
) -> None:
    """A Job and a CronJob run `flagella certs k8s-sync` for every service
    (or, with cert-manager, for the nodes alone from cert-manager's CA); the
    datapath's node-cert Role grants nothing until certgen names the node
    Secrets in it, and is bound to the datapath alone."""
    objs = objects(rendered[target])
    commands = certgen_commands(objs)
    assert len(commands) == 2
    with_cert_manager = target.endswith("cert-manager")
    for command in commands:
        assert command[:3] == ["/opt/flagella/bin/flagella", "certs", "k8s-sync"]
        services = {a.removeprefix("--service=") for a in command if a.startswith("--service=")}
        assert services == (set() if with_cert_manager else set(TLS_SERVICES))
        assert ("--external-ca" in command) == with_cert_manager
        assert "--nodes-from-api" in command
        assert f"--node-role={NODE_CERTS_ROLE}" in command
        # etcd's certificates, from its own CA, with cert-manager or not.
        assert "--etcd-server=etcd" in command
        etcd_clients = [a.removeprefix("--etcd-client=") for a in command if "-etcd-client=" in a]
        assert sorted(etcd_clients) == sorted([*SERVICES, "root"])
    [role] = [o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == NODE_CERTS_ROLE]
    assert role["rules"] == []
    bindings = [
        o for o in objs if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == NODE_CERTS_ROLE
    ]
    assert [s["name"] for b in bindings for s in b["subjects"]] == ["flagella-datapath"]


def test_the_cert_manager_overlay_issues_the_identities_certgen_would(
    rendered: dict[str, Path],
) -> None:
    """Its Certificates: the CA (self-signed, into flagella-ca), and each
    service's and the operator's with its spiffe URI SAN, the names certgen
    gives it, into the Secret the workloads mount, signed by that CA."""
    from flagella.cli.certs import default_names

    objs = objects(rendered["k8s/overlays/cert-manager"])
    certificates = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "Certificate"}
    issuers = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "Issuer"}
    ca = certificates.pop("flagella-ca")
    assert ca["isCA"] is True
    assert ca["secretName"] == "flagella-ca"
    assert "selfSigned" in issuers[ca["issuerRef"]["name"]]
    expected = {f"flagella-service-{s}": ("service", s) for s in TLS_SERVICES}
    expected["flagella-operator-admin"] = ("operator", "admin")
    assert set(certificates) == set(expected)
    for name, (kind, who) in expected.items():
        spec = certificates[name]
        assert spec["secretName"] == name
        assert spec["uris"] == [f"spiffe://flagella/{kind}/{who}"]
        assert issuers[spec["issuerRef"]["name"]] == {"ca": {"secretName": "flagella-ca"}}
        assert "client auth" in spec["usages"]
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        if kind == "service":
            assert spec["dnsNames"] == default_names("service", who)
            assert "server auth" in spec["usages"]
        else:
            assert "dnsNames" not in spec


@pytest.mark.parametrize("target", TARGETS)
def test_the_datapath_carries_a_valid_routing_mode_and_tunnel_port(
    rendered: dict[str, Path], target: str
) -> None:
    """The DaemonSet names the routing mode and the tunnel port, and the
    datapath accepts them (as it would at start, from its environment)."""
    (ds,) = [o for o in objects(rendered[target]) if is_datapath(o)]
    (container,) = [c for c in pod_spec(ds)["containers"] if c["name"] == "datapath"]
    env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    assert env["FLAGELLA_DATAPATH_ROUTING_MODE"] in ROUTING_MODES
    cfg = load_config(
        DatapathConfig,
        prog="flagella-datapath",
        env_prefix="FLAGELLA_DATAPATH_",
        argv=[],
        environ={
            "FLAGELLA_DATAPATH_ROUTING_MODE": env["FLAGELLA_DATAPATH_ROUTING_MODE"],
            "FLAGELLA_DATAPATH_TUNNEL_PORT": env["FLAGELLA_DATAPATH_TUNNEL_PORT"],
            "FLAGELLA_DATAPATH_NODE_IP": "10.0.0.1",
            "FLAGELLA_DATAPATH_NODE_NAME": "node-a",
        },
    )
    assert (cfg.routing_mode, cfg.tunnel_port) == ("tunnel", 8472)


@pytest.mark.parametrize("target", TARGETS)
def test_the_cli_in_any_pod_finds_the_services_from_their_link_variables(
    rendered: dict[str, Path], target: str
) -> None:
    """`flagella` inside any flagella pod needs no flags: the kubelet gives
    every pod <SVC>_SERVICE_HOST/_PORT of the Services in its namespace (no
    workload turns that off), and the CLI reads them."""
    objs = objects(rendered[target])
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    for obj, spec in workloads(rendered[target]):
        assert spec.get("enableServiceLinks", True), obj["metadata"]["name"]
    for svc in CLI_SERVICES:
        port = services[svc]["spec"]["ports"][0]["port"]
        link = {
            f"{svc.upper()}_SERVICE_HOST": "10.96.0.9",
            f"{svc.upper()}_SERVICE_PORT": str(port),
        }
        assert default_address(svc, link) == f"10.96.0.9:{LOCAL_PORTS[svc]}"


@pytest.mark.parametrize("target", TARGETS)
def test_every_service_pod_is_annotated_for_scraping_at_its_declared_metrics_port(
    rendered: dict[str, Path], target: str
) -> None:
    """prometheus.io/scrape and /port on each service's pods, the port
    declared (`metrics`) and the one the service listens on (not loopback:
    a scraper comes from elsewhere), at docs/metrics.md's default; the
    shipped Kubernetes scrape configuration keeps exactly these pods."""
    ports = documented_ports()
    k8s_jobs = {
        job["job_name"]: job["relabel_configs"][0]["regex"]
        for job in yaml.safe_load(PROMETHEUS_K8S.read_text())["scrape_configs"]
    }
    objs = objects(rendered[target])
    pods = {o["metadata"]["name"]: o for o in objs if o["kind"] in WORKLOADS}
    for svc in ports:
        obj = pods[svc]
        spec = pod_spec(obj)
        template = obj["spec"]["template"]["metadata"]
        assert template["annotations"]["prometheus.io/scrape"] == "true", svc
        assert template["annotations"]["prometheus.io/port"] == str(ports[svc]), svc
        [main] = [c for c in spec["containers"] if c["name"] == svc]
        assert {p["name"]: p["containerPort"] for p in main["ports"]}["metrics"] == ports[svc]
        listen = env_of(main)[f"FLAGELLA_{svc.upper()}_METRICS_LISTEN"]
        assert listen in (f"0.0.0.0:{ports[svc]}", f"$(NODE_IP):{ports[svc]}"), (svc, listen)
        name = template["labels"]["app.kubernetes.io/name"]
        assert re.fullmatch(k8s_jobs[svc], f"true;{name}"), svc
    assert not [o for o in objs if o["kind"] == "PodMonitor"]


def test_the_prometheus_operator_overlay_is_the_base_and_a_pod_monitor_per_service(
    rendered: dict[str, Path],
) -> None:
    target = "k8s/overlays/prometheus-operator"
    res = subprocess.run([kubectl(), "kustomize", str(ROOT / target)],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert res.returncode == 0, f"kubectl kustomize {target}:\n{res.stderr}"
    objs = [d for d in yaml.safe_load_all(res.stdout) if d]
    base = objects(rendered["k8s"])
    assert [o for o in objs if o["kind"] != "PodMonitor"] == base
    monitors = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PodMonitor"}
    ports = documented_ports()
    assert set(monitors) == set(ports)
    pods = {o["metadata"]["name"]: o for o in base if o["kind"] in WORKLOADS}
    for svc, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["namespace"] == "flagella"
        assert monitor["metadata"]["labels"]["app.kubernetes.io/part-of"] == "flagella"
        labels = pods[svc]["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items(), svc
        assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics"), svc


LRP_KIND = "CiliumLocalRedirectPolicy"
POOL_KIND = "CiliumLoadBalancerIPPool"
BGP_KIND = "CiliumBGPPeeringPolicy"


def test_the_local_redirect_policy_crd_is_structural(rendered: dict[str, Path]) -> None:
    """Cilium's kind, which the lb follows (docs/lb.md): namespaced, and its
    schema structural."""
    crd = _crds_by_kind(rendered)[LRP_KIND]
    assert crd["metadata"]["name"] == "ciliumlocalredirectpolicies.cilium.io"
    assert crd["spec"]["scope"] == "Namespaced"
    [version] = crd["spec"]["versions"]
    assert version["name"] == "v2"
    _structural(version["schema"]["openAPIV3Schema"], LRP_KIND)


def test_the_load_balancer_ip_pool_crd_is_structural_with_a_status(
    rendered: dict[str, Path],
) -> None:
    """Cilium's LB-IPAM pool kind, which the lb follows and whose status it
    writes (docs/lb.md): cluster-scoped, a status subresource, structural."""
    crd = _crds_by_kind(rendered)[POOL_KIND]
    assert crd["metadata"]["name"] == "ciliumloadbalancerippools.cilium.io"
    assert crd["spec"]["scope"] == "Cluster"
    [version] = crd["spec"]["versions"]
    assert version["name"] == "v2alpha1"
    assert version["subresources"] == {"status": {}}
    _structural(version["schema"]["openAPIV3Schema"], POOL_KIND)


def test_the_bgp_peering_policy_crd_is_structural_and_takes_the_documented_policy(
    rendered: dict[str, Path],
) -> None:
    """Cilium's kind, which the lb follows (docs/bgp.md): cluster-scoped, its
    schema structural, the example of docs/bgp.md valid under it."""
    crd = _crds_by_kind(rendered)[BGP_KIND]
    assert crd["metadata"]["name"] == "ciliumbgppeeringpolicies.cilium.io"
    assert crd["spec"]["scope"] == "Cluster"
    [version] = crd["spec"]["versions"]
    assert version["name"] == "v2alpha1"
    schema = version["schema"]["openAPIV3Schema"]
    _structural(schema, BGP_KIND)
    docs = [
        d
        for text in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs/bgp.md").read_text(), re.S)
        for d in yaml.safe_load_all(text)
        if isinstance(d, dict) and d.get("kind") == BGP_KIND
    ]
    assert docs, "docs/bgp.md has no example policy"
    for doc in docs:
        jsonschema.validate(doc, schema)
