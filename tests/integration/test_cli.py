"""The `flagella` CLI against a running suite: every command group, as a
table and as JSON, and its one-line error when a service is down."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from harness import tls
from harness.browser import artifacts, chromium
from harness.cluster import Cluster, Node
from harness.cni import cni, netconf
from harness.metrics import check_documented, value
from harness.net import free_port
from harness.netns import wait_until
from harness.procs import ServiceProcess
from selenium.webdriver.common.actions.action_builder import ActionBuilder
from selenium.webdriver.common.by import By

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.api.relay.v1 import relay_pb2, relay_pb2_grpc

pytestmark = [pytest.mark.privileged, pytest.mark.integration, pytest.mark.beside_kernel]

CLI = str(Path(sys.executable).parent / "flagella")
HUBBLE_FLOW = jsonschema.Draft202012Validator(
    json.loads((Path(__file__).parents[1] / "schemas" / "hubble-flow.schema.json").read_text())
)
POLICY = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: db-from-api, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: db}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: api}}]
    toPorts: [{ports: [{port: "5432", protocol: TCP}]}]
"""


BGP_POLICY = """
apiVersion: cilium.io/v2alpha1
kind: CiliumBGPPeeringPolicy
metadata: {name: rack9}
spec:
  nodeSelector: {matchLabels: {rack: rack9}}
  virtualRouters:
  - localASN: 65001
    exportPodCIDR: true
    neighbors:
    - {peerAddress: 192.0.2.254/32, peerASN: 64512}
"""


@pytest.fixture
def suite(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> tuple[Cluster, Node]:
    # The CLI finds its operator certificate here.
    monkeypatch.setenv("FLAGELLA_TLS_DIR", str(tls.session().bundle(tls.OPERATOR)))
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    return cluster, cluster.add_node("n1")


def addresses(cluster: Cluster, node: Node) -> list[str]:
    out = []
    for svc in ("ipam", "policy", "lb", "endpoint"):
        out += [f"--{svc}-address", cluster.services[svc].address]
    return [*out, "--datapath-address", node.address]


def run(
    cluster: Cluster, node: Node, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [CLI, *addresses(cluster, node), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def as_json(cluster: Cluster, node: Node, *args: str) -> Any:
    return json.loads(run(cluster, node, "-o", "json", *args).stdout)


def add_pod(cluster: Cluster, node: Node, name: str, labels: dict[str, str]) -> str:
    ns = cluster.pod(node, name)
    rc, result = cni(
        "ADD",
        netconf(node.cni_socket, labels),
        container_id=f"ctr-{name}",
        netns=ns.path,
        pod=("shop", name),
    )
    assert rc == 0, result
    return str(result["ips"][0]["address"]).split("/")[0]


def test_every_command_group(suite: tuple[Cluster, Node], tmp_path: Path) -> None:
    cluster, node = suite
    api_ip = add_pod(cluster, node, "api", {"app": "api"})
    db_ip = add_pod(cluster, node, "db", {"app": "db"})
    other_ip = add_pod(cluster, node, "other", {"app": "other"})

    status = run(cluster, node, "status").stdout
    for svc in ("ipam", "policy", "endpoint", "lb", "datapath"):
        assert f"{svc}" in status
    assert "SERVING" in status
    assert "PRESSURE" in status
    data = as_json(cluster, node, "status")
    assert {s["status"] for s in data["services"].values()} == {"SERVING"}
    # Its reader gone (`flagella status | head`), the CLI ends quietly.
    gone = subprocess.Popen(
        [CLI, *addresses(cluster, node), "status"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert gone.stdout is not None
    gone.stdout.close()
    _, err = gone.communicate(timeout=60)
    assert (gone.returncode, err) == (141, "")
    assert any(m["name"] == "policy" and m["max_entries"] > 0 for m in data["maps"])
    # Pressure as the datapath exports it: none for the arrays full by
    # design, entries over max entries for the others.
    pressure = {m["name"]: m["pressure"] for m in data["maps"]}
    assert pressure["config"] is None
    assert pressure["metrics"] is None
    assert 0 < pressure["endpoints"] < 0.01
    rows = {line.split()[-4]: line.split()[-1] for line in status.splitlines()[-len(pressure) :]}
    assert rows["config"] == rows["metrics"] == "-"
    assert rows["endpoints"].endswith("%")

    # endpoints
    table = run(cluster, node, "endpoint", "list").stdout
    assert "shop/api" in table
    assert "ready" in table
    eps = as_json(cluster, node, "endpoint", "list")
    api = next(e for e in eps if e["pod_name"] == "api")
    got = as_json(cluster, node, "endpoint", "get", str(api["id"]))
    assert got["addresses"] == [f"{api_ip}/32"]
    log = run(cluster, node, "endpoint", "log", str(api["id"])).stdout
    assert "waiting-for-identity" in log
    assert "ready" in log

    # identities and the ipcache
    idents = as_json(cluster, node, "identity", "list")
    api_ident = next(i for i in idents if any(lb.get("value") == "api" for lb in i["labels"]))
    assert "k8s:app=api" in run(cluster, node, "identity", "get", str(api_ident["id"])).stdout
    assert api_ip in run(cluster, node, "ipcache", "list").stdout
    assert {e["prefix"] for e in as_json(cluster, node, "ipcache", "list")} >= {
        api_ip,
        db_ip,
        other_ip,
    }

    # policy: import, get, trace, delete
    doc = tmp_path / "policy.yaml"
    doc.write_text(POLICY)
    assert "shop/db-from-api" in run(cluster, node, "policy", "import", str(doc)).stdout
    assert "shop/db-from-api" in run(cluster, node, "policy", "get").stdout
    assert (
        as_json(cluster, node, "policy", "get", "shop/db-from-api")[0]["name"] == "shop/db-from-api"
    )
    allowed = run(
        cluster,
        node,
        "policy",
        "trace",
        "--src",
        "app=api,io.kubernetes.pod.namespace=shop",
        "--dst",
        "app=db,io.kubernetes.pod.namespace=shop",
        "--dport",
        "5432",
    ).stdout
    assert "Final verdict: ALLOW" in allowed
    denied = run(
        cluster,
        node,
        "policy",
        "trace",
        "--src",
        "app=other,io.kubernetes.pod.namespace=shop",
        "--dst",
        "app=db,io.kubernetes.pod.namespace=shop",
        "--dport",
        "5432",
    ).stdout
    assert "Final verdict: DENY" in denied

    # monitor: a denied connection, with its reason in words
    db_ns = node.pods["db"]
    db_ns.serve("tcp", 5432, "db")
    other_ns = node.pods["other"]
    assert wait_until(lambda: other_ns.request("tcp", db_ip, 5432, timeout=1) is None)
    flows = run(
        cluster, node, "monitor", "--verdict", "dropped", "--last", "20", "--no-follow"
    ).stdout
    assert f"{other_ip}" in flows
    assert "policy denied (L3: peer identity not allowed)" in flows
    as_lines = run(
        cluster, node, "-o", "json", "monitor", "--verdict", "dropped", "--last", "5", "--no-follow"
    ).stdout.splitlines()
    assert all(json.loads(line)["verdict"] == "FLOW_VERDICT_DROPPED" for line in as_lines)
    follow = subprocess.Popen(
        [
            CLI,
            *addresses(cluster, node),
            "monitor",
            "--verdict",
            "dropped",
            "--ip",
            other_ip,
            "--duration",
            "8",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.0)  # the CLI starts and subscribes
    for _ in range(2):
        assert other_ns.request("tcp", db_ip, 5432, timeout=0.5) is None
    out, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0
    assert "DROPPED" in out
    assert other_ip in out
    check_observe(cluster, node, other_ip, db_ip)
    assert "deleted" not in run(cluster, node, "policy", "delete", "shop/db-from-api").stderr

    # services, ipam, maps
    cluster.lb().UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=lb_pb2.Service(
                name="shop/db",
                frontend=lb_pb2.Frontend(
                    address="10.96.5.5", port=5432, protocol=lb_pb2.PROTOCOL_TCP
                ),
                type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
                backends=[lb_pb2.Backend(address=db_ip, port=5432)],
            )
        ),
        timeout=10,
    )
    assert "10.96.5.5:5432/TCP" in run(cluster, node, "service", "list").stdout
    assert (
        as_json(cluster, node, "service", "get", "shop/db")[0]["frontend"]["address"] == "10.96.5.5"
    )
    # LB-IPAM: a pool put through the CLI, a LoadBalancer service's address
    # in service list, a pending one's reason, the pool's use.
    run(cluster, node, "lb-pool", "put", "shop-pool", "203.0.113.8/31", "--selector", "tier=db")
    lb_svc = lb_pb2.Service(
        name="shop/db-lb",
        frontend=lb_pb2.Frontend(address="10.96.5.6", port=5432, protocol=lb_pb2.PROTOCOL_TCP),
        labels={"tier": "db"},
        load_balancer=lb_pb2.LoadBalancer(),
        external_ips=["192.0.2.20"],
        external_traffic_policy=lb_pb2.TRAFFIC_POLICY_LOCAL,
    )
    cluster.lb().UpsertService(lb_pb2.UpsertServiceRequest(service=lb_svc), timeout=10)
    lb_svc.name, lb_svc.frontend.address, lb_svc.labels["tier"] = "shop/web-lb", "10.96.5.7", "web"
    del lb_svc.external_ips[:]
    lb_svc.external_traffic_policy = lb_pb2.TRAFFIC_POLICY_CLUSTER
    cluster.lb().UpsertService(lb_pb2.UpsertServiceRequest(service=lb_svc), timeout=10)
    listed = run(cluster, node, "service", "list").stdout
    assert "203.0.113.8" in listed, listed
    assert "<pending: no_pool>" in listed, listed
    # The external IP after the LoadBalancer address, and eTP.
    (db_lb,) = [line for line in listed.splitlines() if "shop/db-lb" in line]
    assert "203.0.113.8,192.0.2.20" in db_lb, db_lb
    assert "Local" in db_lb.split(), db_lb
    (web_lb,) = [line for line in listed.splitlines() if "shop/web-lb" in line]
    assert "Cluster" in web_lb.split(), web_lb
    pools = as_json(cluster, node, "lb-pool", "list")
    assert [(p["name"], p["used"], p["size"], p["source"]) for p in pools] == [
        ("shop-pool", "1", "2", "api")
    ]
    assert "shop-pool" in run(cluster, node, "lb-pool", "delete", "shop-pool").stdout
    # BGP: a peering policy from a CiliumBGPPeeringPolicy file (it selects
    # no node here), its refusal naming the field, the node's speaker.
    bgp_file = tmp_path / "bgp.yaml"
    bgp_file.write_text(BGP_POLICY)
    assert "rack9" in run(cluster, node, "bgp", "policy", "put", str(bgp_file)).stdout
    listed_bgp = run(cluster, node, "bgp", "policy", "list").stdout
    assert "rack9" in listed_bgp, listed_bgp
    assert "192.0.2.254/AS64512" in listed_bgp, listed_bgp
    [bgp_json] = as_json(cluster, node, "bgp", "policy", "list")
    assert bgp_json["virtual_routers"][0]["local_asn"] == "65001"
    bgp_file.write_text(BGP_POLICY.replace("localASN: 65001", "localASN: 0"))
    refused = run(cluster, node, "bgp", "policy", "put", str(bgp_file), check=False)
    assert refused.returncode != 0
    assert "policy.virtual_routers[0].local_asn" in refused.stderr, refused.stderr
    peers = as_json(cluster, node, "bgp", "peers")
    assert [entry["speaker"]["state"] for entry in peers.values()] == ["disabled"]
    assert "rack9" in run(cluster, node, "bgp", "policy", "delete", "rack9").stdout
    allocs = as_json(cluster, node, "ipam", "list", "--node", "n1")
    assert {a["ip"] for a in allocs} == {api_ip, db_ip, other_ip}
    assert "ctr-api" in run(cluster, node, "ipam", "list").stdout
    maps = as_json(cluster, node, "map", "list")
    assert {"endpoints", "policy", "ipcache", "ct", "services"} <= {m["name"] for m in maps}
    assert api_ip in run(cluster, node, "map", "dump", "endpoints").stdout
    dump = as_json(cluster, node, "map", "dump", "endpoints")
    assert {e["key"]["ip"] for e in dump["entries"]} == {api_ip, db_ip, other_ip}


def test_policy_import_prints_what_it_read_differently(
    suite: tuple[Cluster, Node], tmp_path: Path
) -> None:
    """A CIDR with host bits (as upstream's e2e writes ipBlocks) is imported
    masked, with a warning naming the field on stderr (not in the table)."""
    cluster, node = suite
    doc = tmp_path / "ipblock.yaml"
    doc.write_text(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        "metadata: {name: cidr, namespace: x}\n"
        "spec: {podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.244.0.108/4}}]}]}\n"
    )
    out = run(cluster, node, "policy", "import", str(doc))
    assert "x/cidr" in out.stdout
    assert "host bits" not in out.stdout
    assert out.stderr.strip() == (
        "warning: spec.ingress[0].from[0].ipBlock.cidr: 10.244.0.108/4 has host bits set; "
        "read as 0.0.0.0/4"
    )
    assert as_json(cluster, node, "policy", "get", "x/cidr")[0]["ingress"][0]["cidrs"] == [
        {"cidr": "0.0.0.0/4"}
    ]


def test_errors_when_a_service_is_down(suite: tuple[Cluster, Node]) -> None:
    cluster, node = suite
    dead = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [CLI, "--policy-address", dead, "identity", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"flagella: policy service unreachable at {dead}")
    status = subprocess.run(
        [CLI, *addresses(cluster, node)[:-2], "--datapath-address", dead, "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 1
    assert "DOWN" in status.stdout
    assert dead in status.stdout
    bad = run(cluster, node, "endpoint", "get", "999", check=False)
    assert bad.returncode == 1
    assert bad.stderr.strip() == "flagella: endpoint: NOT_FOUND: id: no endpoint 999"


def cli_in(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with no address flags, in an environment made of env (and the
    operator certificate): what a flagella container gives it."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLAGELLA_")}
    base["FLAGELLA_TLS_DIR"] = os.environ["FLAGELLA_TLS_DIR"]
    return subprocess.run(
        [CLI, *args], env={**base, **env}, capture_output=True, text=True, timeout=60, check=False
    )


def check_observe(cluster: Cluster, node: Node, other_ip: str, db_ip: str) -> None:
    """`flagella observe`: Hubble's JSON (each line valid against the schema
    written from Hubble's protos), the denied connection of other -> db with
    Cilium's reason and both pods; hubble's filters; the table names the pods;
    a closed pipe ends it quietly."""

    def observe(*args: str) -> list[dict[str, Any]]:
        out = run(cluster, node, "observe", "-o", "json", "--last", "100", *args).stdout
        lines = [json.loads(line) for line in out.splitlines()]
        for line in lines:
            HUBBLE_FLOW.validate(line)
        return [line["flow"] for line in lines]

    def ours(flows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            f
            for f in flows
            if f["IP"] == {"source": other_ip, "destination": db_ip, "ipVersion": "IPv4"}
        ]

    drops = ours(observe("--verdict", "dropped"))
    assert drops
    drop = drops[-1]
    assert (drop["verdict"], drop["drop_reason"], drop["drop_reason_desc"]) == (
        "DROPPED", 133, "POLICY_DENIED"
    )  # fmt: skip
    assert drop["event_type"] == {"type": 1, "sub_type": 133}
    assert (drop["node_name"], drop["traffic_direction"], drop["Type"]) == (
        "n1",
        "INGRESS",
        "L3_L4",
    )
    assert drop["l4"]["TCP"]["destination_port"] == 5432
    assert drop["l4"]["TCP"]["flags"] == {"SYN": True}
    assert drop["Summary"] == "TCP Flags: SYN"
    src, dst = drop["source"], drop["destination"]
    assert (src["pod_name"], src["namespace"], dst["pod_name"], dst["namespace"]) == (
        "other", "shop", "db", "shop"
    )  # fmt: skip
    assert "k8s:app=db" in dst["labels"]
    assert "k8s:app=other" in src["labels"]
    assert dst["ID"] > 0
    assert src["identity"] > 0
    assert dst["identity"] > 0

    # Filters: each selects the drop or leaves it out, as hubble's.
    def selects(*args: str) -> bool:
        return bool(ours(observe(*args)))

    assert selects("--pod", "shop/oth", "--namespace", "shop", "--label", "app=other")
    assert selects("--pod", "db", "--identity", str(dst["identity"]), "--port", "5432")
    assert selects("--drop-reason", "POLICY_DENIED", "--traffic-direction", "ingress")
    assert selects("--protocol", "tcp", "--since", "10m")
    assert not selects("--pod", "shop/api")
    assert not selects("--namespace", "default")
    assert not selects("--label", "app=db,tier=web")
    assert not selects("--pod", "db", "--identity", str(src["identity"]))  # not on one end
    assert not selects("--drop-reason", "181")
    assert not selects("--traffic-direction", "egress", "--verdict", "dropped")
    assert not selects("--since", "2099-01-01T00:00:00Z")
    assert len(observe("--last", "1")) == 1
    bad = run(cluster, node, "observe", "--drop-reason", "NOPE", check=False)
    assert (bad.returncode, bad.stderr) == (
        1,
        "flagella: --drop-reason: unknown drop reason 'NOPE'\n",
    )
    table = run(cluster, node, "observe", "--pod", "shop/other").stdout
    assert f"{other_ip}:" in table
    assert "(shop/other, id" in table
    assert "(shop/db, id" in table

    # `observe -o json -f | head -1`: one line, status 0, no traceback.
    cmd = " ".join(
        [CLI, *addresses(cluster, node), "observe", "-o", "json", "-f", "--duration", "30"]
    )
    piped = subprocess.Popen(
        ["bash", "-c", f"set -o pipefail; {cmd} --verdict dropped | head -1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    other_ns, db_port = node.pods["other"], 5432
    assert wait_until(
        lambda: (
            other_ns.request("tcp", db_ip, db_port, timeout=0.3) is None
            and piped.poll() is not None
        ),
        timeout=30,
    )
    out, err = piped.communicate(timeout=10)
    assert (piped.returncode, err) == (0, "")
    assert len(out.splitlines()) == 1
    HUBBLE_FLOW.validate(json.loads(out))


def test_no_flags_inside_a_container_every_node_from_the_registry(
    suite: tuple[Cluster, Node], tmp_path: Path
) -> None:
    """Inside a flagella container the CLI needs no flags: the endpoint
    container's own listener and the peers it was given, the lb Service's
    Kubernetes variables; the datapaths of both nodes through the node
    registry, all by default, one with --node."""
    cluster, n1 = suite
    n2 = cluster.add_node("n2")
    a_ip = add_pod(cluster, n1, "a", {"app": "db"})
    b_ip = add_pod(cluster, n2, "b", {"app": "db"})
    c_ip = add_pod(cluster, n1, "c", {"app": "c"})
    d_ip = add_pod(cluster, n2, "d", {"app": "d"})
    lb_host, _, lb_port = cluster.services["lb"].address.rpartition(":")
    # The flow relay, which observe asks; a long sort window: the live
    # flows of both nodes come out in time order even when polled apart.
    relay = cluster.spawn(
        "relay",
        "--ipam-address", cluster.services["ipam"].address,
        "--endpoint-address", cluster.services["endpoint"].address,
        "--policy-address", cluster.services["policy"].address,
        "--lb-address", cluster.services["lb"].address,
        "--sort-buffer-drain-timeout", "2",
        "--node-probe-interval", "0.5",
    )  # fmt: skip
    env = {
        "FLAGELLA_ENDPOINT_LISTEN": cluster.services["endpoint"].address,
        "FLAGELLA_ENDPOINT_IPAM_ADDRESS": cluster.services["ipam"].address,
        "FLAGELLA_ENDPOINT_POLICY_ADDRESS": cluster.services["policy"].address,
        "LB_SERVICE_HOST": lb_host,
        "LB_SERVICE_PORT": lb_port,
        "FLAGELLA_RELAY_ADDRESS": relay.address,
    }
    status = cli_in(env, "-o", "json", "status")
    assert status.returncode == 0, status.stdout + status.stderr
    data = json.loads(status.stdout)
    assert set(data["services"]) == {
        "ipam", "policy", "endpoint", "lb", "datapath/n1", "datapath/n2"
    }  # fmt: skip
    assert {s["status"] for s in data["services"].values()} == {"SERVING"}
    assert {m["node"] for m in data["maps"]} == {"n1", "n2"}
    one = json.loads(cli_in(env, "-o", "json", "status", "--node", "n2").stdout)
    assert [s for s in one["services"] if s.startswith("datapath")] == ["datapath/n2"]

    # A one-node command names its node when there are several.
    ambiguous = cli_in(env, "map", "list")
    assert ambiguous.returncode == 1
    assert ambiguous.stderr.strip() == "flagella: 2 nodes (n1, n2): name one with --node"
    dump = json.loads(cli_in(env, "-o", "json", "map", "dump", "endpoints", "--node", "n2").stdout)
    assert {e["key"]["ip"] for e in dump["entries"]} == {b_ip, d_ip}
    unknown = cli_in(env, "map", "list", "--node", "n9")
    assert unknown.returncode == 1
    assert "no node 'n9' with a datapath in the registry (nodes: n1, n2)" in unknown.stderr
    in_n1 = cli_in(
        {**env, "FLAGELLA_DATAPATH_NODE_NAME": "n1"}, "-o", "json", "map", "dump", "endpoints"
    )
    assert {e["key"]["ip"] for e in json.loads(in_n1.stdout)["entries"]} == {a_ip, c_ip}

    # Flows of every node, each line naming its node.
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=POLICY), timeout=10)
    n1.pods["a"].serve("tcp", 5432, "a")
    n2.pods["b"].serve("tcp", 5432, "b")
    assert wait_until(lambda: n1.pods["c"].request("tcp", a_ip, 5432, timeout=1) is None)
    assert wait_until(lambda: n2.pods["d"].request("tcp", b_ip, 5432, timeout=1) is None)
    flows = cli_in(
        env, "-o", "json", "monitor", "--verdict", "dropped", "--last", "50", "--no-follow"
    )
    assert flows.returncode == 0, flows.stderr
    nodes = {json.loads(line)["node"] for line in flows.stdout.splitlines()}
    assert nodes == {"n1", "n2"}
    table = cli_in(env, "monitor", "--node", "n2", "--last", "50", "--no-follow").stdout
    assert d_ip in table
    assert all(line.startswith("n2 ") for line in table.splitlines())
    # observe: both nodes' flows in one time order, each with its node; --node globs.
    merged = cli_in(env, "observe", "-o", "json", "--verdict", "dropped", "--last", "50")
    lines = [json.loads(line) for line in merged.stdout.splitlines()]
    assert {line["node_name"] for line in lines} == {"n1", "n2"}
    times = [(t[:19], float(f"0{t[19:-1]}")) for t in (line["time"] for line in lines)]
    assert times == sorted(times)
    n2_only = cli_in(env, "observe", "-o", "json", "--node", "*2", "--last", "50").stdout
    assert {json.loads(line)["flow"]["node_name"] for line in n2_only.splitlines()} == {"n2"}
    check_relay_follow(cluster, env, relay, (n1, "c", a_ip), (n2, "d", b_ip))
    check_flows_page(cluster, env, relay, tmp_path, (n1, "c", a_ip), (n2, "d", b_ip))


def check_relay_follow(
    cluster: Cluster,
    env: dict[str, str],
    relay: ServiceProcess,
    *pairs: tuple[Node, str, str],
) -> None:
    """One `observe -o json -f` stream through the relay: new flows of both
    nodes, in time order, each with its node; n2's datapath stopped
    mid-stream is reported UNAVAILABLE within 5 s, CONNECTED once it is
    back; the relay's GetNodes has both, with the flows it saw."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLAGELLA_")}
    proc = subprocess.Popen(
        [CLI, "observe", "-o", "json", "-f", "--verdict", "dropped", "--duration", "90"],
        env={**base, "FLAGELLA_TLS_DIR": os.environ["FLAGELLA_TLS_DIR"], **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[dict[str, Any]] = queue.Queue()
    seen: list[dict[str, Any]] = []

    def read() -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            lines.put(json.loads(text))

    threading.Thread(target=read, daemon=True).start()

    def wait_for(wanted: Any, timeout: float, poke: Any = None) -> bool:
        """Reads lines until one satisfies wanted (poke() each 0.5 s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if poke is not None:
                poke()
            with contextlib.suppress(queue.Empty):
                while True:
                    line = lines.get(timeout=0.5)
                    HUBBLE_FLOW.validate(line)
                    seen.append(line)
                    if wanted(line):
                        return True
        return False

    def status_of(node: str, state: str) -> Any:
        return lambda line: (
            line.get("node_status", {}).get("state_change") == state
            and line["node_status"]["node_names"] == [node]
        )

    def traffic() -> None:
        """Each node's denied connection (a drop, a flow) once more."""
        for node, pod, dst in pairs:
            node.pods[pod].request("tcp", dst, 5432, timeout=0.2)

    try:
        assert wait_for(status_of("n2", "NODE_CONNECTED"), 15)
        nodes_seen: set[str] = set()

        def both(line: dict[str, Any]) -> bool:
            if "flow" in line:
                nodes_seen.add(line["node_name"])
            return nodes_seen == {"n1", "n2"}

        assert wait_for(both, 30, poke=traffic), seen
        flows = [line for line in seen if "flow" in line]
        assert all(line["flow"]["node_name"] == line["node_name"] for line in flows)
        times = [line["time"] for line in flows]
        assert times == sorted(times, key=_rfc3339_ns), times

        n2 = pairs[1][0]
        assert n2.process is not None
        n2.process.stop()
        stopped = time.monotonic()
        assert wait_for(status_of("n2", "NODE_UNAVAILABLE"), 5), seen[-5:]
        assert time.monotonic() - stopped < 5
        cluster.start_datapath(n2)
        assert wait_for(status_of("n2", "NODE_CONNECTED"), 30), seen[-5:]
        assert proc.poll() is None  # the stream goes on

        got = relay_pb2_grpc.RelayServiceStub(relay.channel()).GetNodes(
            relay_pb2.GetNodesRequest(), timeout=10
        )
        by_name = {n.name: n for n in got.nodes}
        assert set(by_name) == {"n1", "n2"}
        assert by_name["n1"].state == relay_pb2.NODE_STATE_CONNECTED
        assert by_name["n2"].address == n2.address
        assert by_name["n2"].last_error  # why it was unavailable
        assert all(n.flows_seen > 0 for n in got.nodes)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def check_flows_page(
    cluster: Cluster,
    env: dict[str, str],
    relay: ServiceProcess,
    tmp_path: Path,
    *pairs: tuple[Node, str, str],
) -> None:
    """The relay's web page in Debian's headless Chromium: live flows of
    both nodes make the service map (the two app=db pods one workload node,
    c and d each theirs, a service without backends c calls), edges marked dropped with Cilium's reason on
    hover, the table's rows, a filter narrowing them; a screenshot kept.
    Beside it: the page's API refuses bad input by field and a foreign
    Host; the relay's own metrics; `flagella status` names the relay and
    the nodes it follows."""
    base = f"http://{relay.ui_listen}"
    check_page_api(base)

    # A service without a backend: c's connections to it are dropped there
    # (SERVICE_BACKEND_NOT_FOUND), addressed to its frontend.
    web = lb_pb2.Service(name="shop/web", type=lb_pb2.SERVICE_TYPE_CLUSTER_IP)
    web.frontend.address, web.frontend.port = "10.96.7.7", 80
    web.frontend.protocol = lb_pb2.PROTOCOL_TCP
    cluster.lb().UpsertService(lb_pb2.UpsertServiceRequest(service=web), timeout=10)

    def traffic() -> None:
        for node, pod, dst in pairs:
            node.pods[pod].request("tcp", dst, 5432, timeout=0.2)
        pairs[0][0].pods["c"].request("tcp", "10.96.7.7", 80, timeout=0.2)

    with chromium() as page:

        def dom(script: str) -> Any:
            return page.execute_script(script)

        edges_js = """return [...document.querySelectorAll('#map path.edge')].map(e => ({
            src: e.dataset.src, dst: e.dataset.dst, verdict: e.dataset.verdict,
            title: e.querySelector('title').textContent}))"""
        nodes_js = """return Object.fromEntries([...document.querySelectorAll('#map g.node')]
            .map(g => [g.dataset.id, g.dataset.pods]))"""
        # One read of the whole table: it is redrawn as flows come.
        rows_js = """return [...document.querySelectorAll('#flows tbody tr')]
            .map(tr => [...tr.cells].map(td => td.textContent))"""

        def dropped(src: str, dst: str = "pod:shop/db") -> str:
            """The hover text of the dropped edge src -> dst ("" : none yet)."""
            return next(
                (e["title"] for e in dom(edges_js)
                 if (e["src"], e["dst"], e["verdict"]) == (src, dst, "dropped")),
                "",
            )  # fmt: skip

        page.get(f"{base}/")
        nodes = {"pod:shop/db": "a,b", "pod:shop/c": "c", "pod:shop/d": "d"}
        assert wait_until(
            lambda: (
                traffic() is None
                and nodes.items() <= dom(nodes_js).items()
                and all("POLICY_DENIED" in dropped(f"pod:shop/{p}") for p in ("c", "d"))
                and "SERVICE_BACKEND_NOT_FOUND" in dropped("pod:shop/c", "svc:shop/web")
            ),
            timeout=15,
        ), (dom(nodes_js), dom(edges_js))
        hover = dropped("pod:shop/c")
        assert hover.startswith("c \u2192 db: "), hover
        assert "dropped\nPOLICY_DENIED \u00d7 " in hover, hover
        assert "shop" in dom("return [...document.querySelectorAll('#namespace option')]"
                             ".map(o => o.value)")  # fmt: skip

        # Newest first; the forwarded ones from before the policy, buffered.
        every = dom(rows_js)
        assert [r[0] for r in every] == sorted((r[0] for r in every), reverse=True)
        drops = {("DROPPED", f"shop/{p}", "5432", "TCP", "POLICY_DENIED") for p in "ab"}
        drops.add(("DROPPED", "shop/web (service)", "80", "TCP", "SERVICE_BACKEND_NOT_FOUND"))
        assert drops <= {(r[1], r[3], r[4], r[5], r[6]) for r in every}, every
        assert {r[4] for r in every} == {"5432", "80"}
        page.find_element(By.NAME, "pod").send_keys("shop/d")
        only_d = dom(rows_js)
        assert only_d
        assert len(only_d) < len(every)
        assert {(r[2], r[3], r[7]) for r in only_d} == {("shop/d", "shop/b", "n2")}
        page.find_element(By.NAME, "pod").clear()
        # The pointer on the middle of c's dropped edge: its reasons in the tooltip.
        x, y = dom(
            """const e = document.querySelector(
                 'path.edge.dropped[data-src="pod:shop/c"][data-dst="pod:shop/db"]');
               const p = e.getPointAtLength(e.getTotalLength() / 2), m = e.getScreenCTM();
               return [Math.round(p.x * m.a + m.e), Math.round(p.y * m.d + m.f)];"""
        )
        pointer = ActionBuilder(page)
        pointer.pointer_action.move_to_location(x, y)
        pointer.perform()
        tooltip = page.find_element(By.ID, "tooltip")
        assert tooltip.is_displayed()
        assert "POLICY_DENIED \u00d7 " in tooltip.text, tooltip.text
        page.save_screenshot(str(artifacts(tmp_path) / "flows-page.png"))

        scrape = relay.scrape()
        check_documented(scrape)
        assert value(scrape, "flagella_relay_ui_clients") == 1
        assert value(scrape, "flagella_relay_flows_received_total", node="n2") > 0
        assert value(scrape, "flagella_relay_flows_forwarded_total") > 0
        page.get("about:blank")
        assert wait_until(lambda: value(relay.scrape(), "flagella_relay_ui_clients") == 0)

    def relay_in_status() -> Any:
        return json.loads(cli_in(env, "-o", "json", "status", "--brief").stdout)["relay"]

    want = {
        "status": "SERVING",
        "detail": relay.address,
        "nodes": {"n1": "CONNECTED", "n2": "CONNECTED"},
    }
    assert wait_until(lambda: relay_in_status() == want), relay_in_status()
    assert value(relay.scrape(), "flagella_relay_nodes", state="connected") == 2


def check_page_api(base: str) -> None:
    """Bad input is refused naming the field; a request naming the page by
    another host is refused (DNS rebinding); the page allows no other origin."""

    def get(url: str, host: str = "") -> tuple[int, dict[str, Any], Any]:
        request = urllib.request.Request(url, headers={"Host": host} if host else {})
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                return resp.status, json.loads(resp.read()), resp.headers
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), exc.headers

    status, body, _ = get(f"{base}/api/flows?namespace=Not_A_Name")
    assert (status, body["field"]) == (400, "namespace"), body
    status, body, _ = get(f"{base}/api/flows?last=-1")
    assert (status, body["field"]) == (400, "last"), body
    status, body, _ = get(f"{base}/api/nodes", host="evil.example")
    assert status == 421, body
    status, body, headers = get(f"{base}/api/nodes")
    assert status == 200
    assert sorted(n["name"] for n in body["nodes"]) == ["n1", "n2"]
    assert "default-src 'none'" in headers["Content-Security-Policy"]


def _rfc3339_ns(text: str) -> tuple[str, float]:
    return text[:19], float(f"0{text[19:-1]}")


def test_endpoint_get_shows_named_ports(suite: tuple[Cluster, Node]) -> None:
    cluster, node = suite
    ns = cluster.pod(node, "named")
    conf = netconf(node.cni_socket, {"app": "named"})
    conf["args"]["cni"]["namedPorts"] = [{"name": "http", "port": 8080}]
    rc, result = cni("ADD", conf, container_id="ctr-named", netns=ns.path, pod=("shop", "named"))
    assert rc == 0, result
    ep = next(e for e in as_json(cluster, node, "endpoint", "list") if e["pod_name"] == "named")
    got = as_json(cluster, node, "endpoint", "get", str(ep["id"]))
    assert got["named_ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    # From its node's datapath: its policy fits (no lockdown).
    assert got["policy_overflow"] == "none"
    assert got["policy_map_entries"] > 0
    table = run(cluster, node, "endpoint", "get", str(ep["id"])).stdout
    assert "named_ports" in table
    assert "http" in table
