"""Several nodes as pure logic: the routing mode's options, routes per mode,
and the BPF ipcache merged from the policy's ipcache and the node registry
(node IPs, remote pod CIDRs with their tunnel endpoint, prune only once
both sources had their snapshot)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from harness.reconcile import NoOps

from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.common.reconcile import Reconciler
from flagella.datapath.config import DatapathConfig
from flagella.datapath.ipcache import IPCacheInfo, IPCacheView, node_entries, policy_entries
from flagella.datapath.routes import NodeRecord, NodeRoutes


def config(*argv: str) -> DatapathConfig:
    return load_config(
        DatapathConfig, prog="flagella-datapath", env_prefix="X_", argv=list(argv), environ={}
    )


def test_routing_mode_defaults_to_tunnel() -> None:
    cfg = config()
    assert (cfg.routing_mode, cfg.tunnel, cfg.tunnel_port) == ("tunnel", True, 8472)
    assert not config("--routing-mode", "native").tunnel


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--routing-mode", "geneve"], "invalid --routing-mode: 'geneve' is not one of tunnel"),
        (["--tunnel-port", "0"], "invalid --tunnel-port: 0 is not in 1..65535"),
        (["--node-ip", "fd00::1"], "invalid --node-ip: tunnel mode needs an IPv4 node IP"),
        (
            ["--node-ip", "10.0.0.1", "--node-ip", "10.0.0.2"],
            "invalid --node-ip: 10.0.0.2 is a second IPv4 address (one per family)",
        ),
        (["--node-ip", "10.0.0.300"], "invalid --node-ip"),
    ],
)
def test_bad_multinode_options_name_the_option(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(*argv)
    assert str(err.value).startswith(message)
    # An IPv6-only node is fine when it routes natively.
    config("--routing-mode", "native", "--node-ip", "fd00::1")


ME = NodeRecord("me", ("192.168.0.1", "fd00:100::1"), ("10.1.0.0/24", "fd00:10::/112"))
A = NodeRecord("a", ("192.168.0.2", "fd00:100::2"), ("10.2.0.0/24", "fd00:20::/112"))


def test_tunnel_mode_routes_every_remote_cidr_into_the_device() -> None:
    routes: Reconciler[str, str] = Reconciler("routes", NoOps())
    NodeRoutes("me", routes, device="flagella_vxlan").replace_all({"me": ME, "a": A})
    assert routes.desired() == {"10.2.0.0/24": "flagella_vxlan", "fd00:20::/112": "flagella_vxlan"}
    native: Reconciler[str, str] = Reconciler("routes", NoOps())
    NodeRoutes("me", native).replace_all({"me": ME, "a": A})
    assert native.desired() == {"10.2.0.0/24": "192.168.0.2", "fd00:20::/112": "fd00:100::2"}


def test_ipcache_merges_pods_and_nodes() -> None:
    target: Reconciler[str, IPCacheInfo] = Reconciler("ipcache", NoOps())
    view = IPCacheView(target, "me", tunnel=True)
    pods, nodes = policy_entries(view), node_entries(view)

    pods.replace_all({"10.2.0.7/32": 300, "10.1.0.5/32": 301, "8.8.8.0/24": 16777217})
    # Half the picture: nothing changes yet (after a restart the map keeps
    # the entries it holds, tunnel endpoints included).
    assert target.desired() == {}
    nodes.replace_all({"me": ME, "a": A})
    assert target.desired() == {
        # a pod of node a: its identity, a's tunnel endpoint, in the cluster
        "10.2.0.7/32": IPCacheInfo(300, "192.168.0.2", cluster=True),
        # a local pod: no tunnel
        "10.1.0.5/32": IPCacheInfo(301, "", cluster=True),
        # a CIDR identity outside every pod CIDR
        "8.8.8.0/24": IPCacheInfo(16777217),
        # node IPs: this node is host, the other remote-node
        "192.168.0.1/32": IPCacheInfo(1, cluster=True),
        "fd00:100::1/128": IPCacheInfo(1, cluster=True),
        "192.168.0.2/32": IPCacheInfo(6, cluster=True),
        "fd00:100::2/128": IPCacheInfo(6, cluster=True),
        # a's pod CIDRs: reached through the tunnel before any pod entry
        "10.2.0.0/24": IPCacheInfo(2, "192.168.0.2", cluster=True),
        "fd00:20::/112": IPCacheInfo(2, "192.168.0.2", cluster=True),
    }

    # a moves to another address: every entry inside its CIDRs follows.
    nodes.upsert("a", NodeRecord("a", ("192.168.0.9",), A.pod_cidrs))
    assert target.get("10.2.0.7/32") == IPCacheInfo(300, "192.168.0.9", cluster=True)
    assert target.get("192.168.0.2/32") is None
    # a goes: its node IP and CIDRs go; its pod's entry stays until the
    # policy's ipcache drops it (its lease), no longer tunnelled.
    nodes.delete("a")
    assert target.get("10.2.0.0/24") is None
    assert target.get("10.2.0.7/32") == IPCacheInfo(300)
    pods.delete("10.2.0.7/32")
    assert target.get("10.2.0.7/32") is None


def test_native_mode_names_no_tunnel_endpoint() -> None:
    target: Reconciler[str, IPCacheInfo] = Reconciler("ipcache", NoOps())
    view = IPCacheView(target, "me", tunnel=False)
    node_entries(view).replace_all({"me": ME, "a": A})
    policy_entries(view).replace_all({"10.2.0.7/32": 300})
    assert target.get("10.2.0.7/32") == IPCacheInfo(300, "", cluster=True)
    assert target.get("10.2.0.0/24") == IPCacheInfo(2, "", cluster=True)


async def test_the_map_is_pruned_only_once_both_sources_had_their_snapshot() -> None:
    deleted: list[object] = []

    class Ops(NoOps):
        async def delete(self, key: object) -> None:
            deleted.append(key)

        async def list_actual(self) -> Iterable[object]:
            return ["10.9.9.9/32"]  # in the map, desired by neither source

    target: Reconciler[str, IPCacheInfo] = Reconciler("ipcache", Ops())
    view = IPCacheView(target, "me", tunnel=True)
    pods, nodes = policy_entries(view), node_entries(view)
    pods.replace_all({"10.2.0.7/32": 300})
    await target.reconcile_once()
    assert deleted == []
    nodes.replace_all({"me": ME})
    await target.reconcile_once()
    assert deleted == ["10.9.9.9/32"]
