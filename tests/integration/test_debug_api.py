"""Map events, debuginfo and cgroup metadata against a small scripted
cluster (etcd, the four control-plane services, the relay, one node's
datapath in a netns, a pod made by the real flagella-cni): a service upsert
through lb shows on the node as map writes in the order the datapath makes
them, a follower sees them as they come, the delete and the history bound
show too; `flagella debuginfo` holds the pod, the rule and the service, a
recent warning, and no key material; the pod's cgroup is found through the
process holding its netns."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import tls
from harness.cluster import Cluster, Node
from harness.cni import cni, netconf
from harness.etcd import session_pki as etcd_pki
from harness.lb import service
from harness.netns import wait_until

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.datapath.cgroups import cgroup2_root

pytestmark = [pytest.mark.privileged, pytest.mark.integration, pytest.mark.beside_kernel]

CLI = str(Path(sys.executable).parent / "flagella")
HISTORY = 4
OTHER = "10.200.99.9"  # a backend that is no pod: the maps do not mind
RULE = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web-from-api, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: api}}]
"""


def add_pod(cluster: Cluster, node: Node, name: str) -> tuple[str, str]:
    """(netns path, IPv4 address) of a pod made by flagella-cni ADD."""
    ns = cluster.pod(node, name)
    rc, result = cni(
        "ADD",
        netconf(node.cni_socket, {"app": name}),
        container_id=f"ctr-{name}",
        netns=ns.path,
        pod=("shop", name),
    )
    assert rc == 0, result
    return ns.path, str(result["ips"][0]["address"]).split("/")[0]


def cli_flags(cluster: Cluster, node: Node, relay: str) -> list[str]:
    flags = [f"--{s}-address={cluster.services[s].address}" for s in ("ipam", "policy", "lb")]
    return [
        *flags,
        f"--endpoint-address={cluster.services['endpoint'].address}",
        f"--relay-address={relay}",
        f"--datapath-address={node.address}",
    ]


def cli(cluster: Cluster, node: Node, relay: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *cli_flags(cluster, node, relay), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def upsert(cluster: Cluster, name: str, vip: str, backends: list[str]) -> lb_pb2.Service:
    """A ClusterIP service on port 80 to port 8080 of backends."""
    svc = service(name, vip, backends=[(b, 8080) for b in backends])
    got = cluster.lb().UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=10)
    return got.service


def events(stub: Any, name: str) -> list[datapath_pb2.MapEvent]:
    return list(stub.GetMapEvents(datapath_pb2.GetMapEventsRequest(name=name), timeout=10))


def test_map_events_debuginfo_and_cgroups_of_a_small_cluster(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLAGELLA_TLS_DIR", str(tls.session().bundle(tls.OPERATOR)))
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    node = cluster.add_node("n1", extra=["--map-event-history", str(HISTORY)])
    relay = cluster.spawn(
        "relay",
        "--ipam-address", cluster.services["ipam"].address,
        "--endpoint-address", cluster.services["endpoint"].address,
        "--policy-address", cluster.services["policy"].address,
        "--lb-address", cluster.services["lb"].address,
    )  # fmt: skip
    web_ns, web_ip = add_pod(cluster, node, "web")
    idle_ns, _ = add_pod(cluster, node, "idle")
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=RULE), timeout=10)
    dp = cluster.datapath(node)

    # A follower from before the upsert gets the writes as they are made.
    follower = dp.GetMapEvents(
        datapath_pb2.GetMapEventsRequest(name="services", follow=True), timeout=60
    )
    followed: list[datapath_pb2.MapEvent] = []

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            followed.extend(follower)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    svc = upsert(cluster, "shop/web", "10.96.0.30", [web_ip, OTHER])
    assert wait_until(lambda: len(events(dp, "services")) == 3)
    services = events(dp, "services")
    backends = events(dp, "backends")
    update = datapath_pb2.MAP_EVENT_ACTION_UPDATE
    ok = datapath_pb2.MAP_EVENT_OUTCOME_OK
    # The backends, then the service's backend slots, then its entry.
    assert sorted((e.value["address"], e.value["port"]) for e in backends) == sorted(
        [(web_ip, "8080"), (OTHER, "8080")]
    )
    assert [(e.key["slot"], e.value["count"]) for e in services] == [
        ("1", "0"),
        ("2", "0"),
        ("0", "2"),
    ]
    assert {(e.action, e.outcome, e.errno, e.key["address"], e.key["port"]) for e in services} == {
        (update, ok, 0, "10.96.0.30", "80")
    }
    assert {e.value["service_id"] for e in services} == {str(svc.id)}
    assert max(e.seq for e in backends) < services[0].seq < services[1].seq < services[2].seq
    assert all(e.time.seconds > 0 and e.map == "backends" for e in backends)
    assert wait_until(lambda: len(followed) >= 3)
    assert [e.seq for e in followed[:3]] == [e.seq for e in services]

    cluster.lb().DeleteService(lb_pb2.DeleteServiceRequest(name="shop/web"), timeout=10)
    delete = datapath_pb2.MAP_EVENT_ACTION_DELETE
    assert wait_until(lambda: events(dp, "services")[-1].action == delete)
    assert wait_until(lambda: sum(e.action == delete for e in events(dp, "services")) == 3)
    after = events(dp, "services")
    # The history holds the last HISTORY writes: the entry went first.
    assert len(after) == HISTORY
    assert [(e.action, e.key["slot"]) for e in after] == [
        (update, "0"), (delete, "0"), (delete, "1"), (delete, "2"),
    ]  # fmt: skip
    assert wait_until(lambda: len(followed) >= 6)
    assert [e.action for e in followed[3:6]] == [delete] * 3
    follower.cancel()
    reader.join(10)
    with pytest.raises(grpc.RpcError) as err:
        events(dp, "nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    # The CLI: the history as a table and as JSON lines.
    table = cli(cluster, node, relay.address, "map", "events", "services")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:4] == ["SEQ", "TIME", "ACTION", "OUTCOME"]
    assert "delete" in table.stdout.splitlines()[-1]
    lines = cli(cluster, node, relay.address, "-o", "json", "map", "events", "services")
    assert [json.loads(line)["seq"] for line in lines.stdout.splitlines()] == [
        str(e.seq) for e in after
    ]
    check_cli_follow(cluster, node, relay.address, web_ip, after[-1].seq)

    check_cgroups(cluster, node, relay.address, web_ns, idle_ns)
    check_debuginfo(cluster, node, relay.address)


def check_cli_follow(cluster: Cluster, node: Node, relay: str, web_ip: str, last: int) -> None:
    """`flagella map events services --follow`: the history, then the
    writes of a service upserted while it runs, as they are made."""
    flags = cli_flags(cluster, node, relay)
    with subprocess.Popen(
        [CLI, *flags, "-o", "json", "map", "events", "services", "--follow", "--duration", "60"],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        try:
            seen = [json.loads(proc.stdout.readline()) for _ in range(HISTORY)]
            assert seen[-1]["seq"] == str(last)
            upsert(cluster, "shop/api", "10.96.0.31", [web_ip])
            new = [json.loads(proc.stdout.readline()) for _ in range(2)]
        finally:
            proc.terminate()
    assert [(e["action"], e["key"]["slot"], e["key"]["address"]) for e in new] == [
        ("MAP_EVENT_ACTION_UPDATE", "1", "10.96.0.31"),
        ("MAP_EVENT_ACTION_UPDATE", "0", "10.96.0.31"),
    ]


def check_cgroups(cluster: Cluster, node: Node, relay: str, web_ns: str, idle_ns: str) -> None:
    """A process in the web pod's netns, in a cgroup of its own: the pod's
    cgroup id (the folder's inode) and path; the idle pod, whose netns no
    process holds, says so."""
    root = cgroup2_root()
    assert root, "no cgroup v2 hierarchy on this machine"
    group = Path(root) / f"flagella-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    sleeper = subprocess.Popen(["nsenter", f"--net={web_ns}", "sleep", "60"])
    try:
        (group / "cgroup.procs").write_text(str(sleeper.pid))
        got = cluster.datapath(node).GetCgroupDumpMetadata(
            datapath_pb2.GetCgroupDumpMetadataRequest(), timeout=10
        )
        assert got.cgroup_root == root
        pods = {p.container_id: p for p in got.pods}
        web = pods["ctr-web"]
        assert [(c.cgroup_id, c.cgroup_path, list(c.pids)) for c in web.containers] == [
            (os.stat(group).st_ino, f"/{group.name}", [sleeper.pid])
        ]
        assert web.netns_path == web_ns
        assert not web.error
        idle = pods["ctr-idle"]
        assert not idle.containers
        assert idle.error == "no process holds the pod's network namespace"
        table = cli(cluster, node, relay, "cgroups")
        assert table.returncode == 0, table.stderr
        assert str(os.stat(group).st_ino) in table.stdout
    finally:
        sleeper.kill()
        sleeper.wait()
        group.rmdir()


def check_debuginfo(cluster: Cluster, node: Node, relay: str) -> None:
    """One document: every service's part and the node's; the pod, the
    rule, the (deleted) service's absence, a recent warning of lb; no key
    material, key files named by path only."""

    async def plant() -> None:  # a key lb cannot read: it warns and skips it
        client = cluster.etcd.client()
        try:
            await client.put("flagella/lb/v1/services/not-a-number", b"{}")
        finally:
            await client.close()

    asyncio.run(plant())

    keys = [*tls.session().root.rglob("*.key"), *etcd_pki().root.rglob("*.key")]
    assert keys

    def report() -> dict[str, Any]:
        out = cli(cluster, node, relay, "debuginfo")
        assert out.returncode == 0, out.stderr
        assert "PRIVATE KEY" not in out.stdout
        for key in keys:  # no line of any key file (the services' and etcd's)
            assert not any(line in out.stdout for line in key.read_text().splitlines()[1:-1])
        doc: dict[str, Any] = json.loads(out.stdout)
        return doc

    assert wait_until(
        lambda: any(
            r["message"] == "not a service key, skipped"
            for r in report()["services"]["lb"].get("recent_errors", [])
        )
    )
    doc = report()
    assert doc["errors"] == {}
    assert set(doc["services"]) == {"ipam", "policy", "endpoint", "lb", "relay"}
    for name, part in [*doc["services"].items(), ("datapath", doc["nodes"]["n1"])]:
        assert part["service"] == name
        assert part["versions"]["python"]
        assert part["versions"]["kernel"]
        assert part["versions"][f"flagella-{name}"]
        assert part["config"]["tls_key"].endswith(".key")
        assert any(r.startswith("tls_key: ") for r in part["redacted"])
    lb = doc["services"]["lb"]
    assert [s["name"] for s in lb["state"]["services"]["services"]] == ["shop/api"]
    warning = next(r for r in lb["recent_errors"] if r["message"] == "not a service key, skipped")
    assert warning["level"] == "warning"
    assert warning["fields"]["key"] == "flagella/lb/v1/services/not-a-number"
    rules = doc["services"]["policy"]["state"]["rules"]["rules"]
    assert [r["name"] for r in rules] == ["shop/web-from-api"]
    assert any(
        {"key": "app", "value": "web"}.items() <= label.items()
        for i in doc["services"]["policy"]["state"]["identities"]["identities"]
        for label in i.get("labels", [])
    )
    endpoints = doc["services"]["endpoint"]["state"]["endpoints"]["endpoints"]
    assert {e["container_id"] for e in endpoints} == {"ctr-web", "ctr-idle"}
    assert [n["name"] for n in doc["services"]["ipam"]["state"]["nodes"]["nodes"]] == ["n1"]
    dp = doc["nodes"]["n1"]
    assert dp["config"]["map_event_history"] == HISTORY
    assert {e["container_id"] for e in dp["state"]["endpoints"]["endpoints"]} == {
        "ctr-web",
        "ctr-idle",
    }
    maps = {m["name"]: m for m in dp["state"]["maps"]}
    assert maps["endpoints"]["entries"] == 2
    assert maps["services"]["max_entries"] > 0
    assert maps["services"]["pressure"] == pytest.approx(
        maps["services"]["entries"] / maps["services"]["max_entries"], abs=1e-4
    )
    assert dp["state"]["status"]["node"] == "n1"
