"""Fan-out to many nodes, small (bench/fanout.py runs hundreds): node
subscribers in four processes (two started after changes), each node with
its own certificate, registered and following every stream a datapath
follows, against real etcd and the control plane. Every node must see a rule change, a service change and a
new endpoint's ipcache entry, and nothing may be left running."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.fanout import FANOUT_EXTRA, KINDS, Fanout, figures
from harness.netns import NetnsSet
from harness.procs import ServiceProcess

from flagella.api.ipam.v1 import ipam_pb2

pytestmark = pytest.mark.integration

NODES = 20


def test_every_node_converges_on_each_change(
    tmp_path: Path, etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    # No network namespace: the nodes are processes of this test.
    cluster = Cluster(tmp_path, etcd, spawn, NetnsSet())
    try:
        cluster.start(services=("ipam", "policy", "lb", "endpoint"), extra=FANOUT_EXTRA)
        fanout = Fanout(cluster, tmp_path, per_worker=NODES // 4)
        try:
            # Grown after changes, as the bench grows from one count to the
            # next: the new nodes take the rule as it is now.
            fanout.grow(NODES // 2)
            fanout.change("rule")
            fanout.change("service")
            fanout.grow(NODES)
            result = fanout.measure(changes=1, rest_seconds=0.5)
            # The registry holds every node, each with the pod CIDR of a /26.
            nodes = cluster.ipam().ListNodes(ipam_pb2.ListNodesRequest(), timeout=10).nodes
            assert sorted(n.name for n in nodes) == sorted(fanout.nodes)
            assert all(n.pod_cidrs[0].endswith("/26") for n in nodes)
        finally:
            codes = fanout.close()
    finally:
        cluster.cleanup()
    assert codes == [0, 0, 0, 0]
    assert all(w.proc.poll() is not None for w in fanout.workers)
    for kind in KINDS:
        # One latency per node: every node saw the change.
        assert len(result.latencies[kind]) == NODES, kind
        assert all(0 <= t < 60 for t in result.latencies[kind]), result.latencies[kind]
    report = figures([result])
    for who in ("ipam", "policy", "lb", "endpoint", "etcd", "nodes"):
        assert report[f"n{NODES}_{who}_rest_rss_mib"] > 0, report
    assert f"n{NODES}_etcd_msg_received_per_node_per_min" in report
