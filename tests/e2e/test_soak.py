"""A one-minute churn soak (bench/soak.py runs it for longer): pods added
and deleted through the real plugin, policy and service updates, probes,
and every service killed with -9 in turn. Nothing may fail beyond the
runtime's retries, no probe may fail outside a kill window, and nothing
may be left behind."""

from __future__ import annotations

import os

import pytest
from harness.cluster import Cluster
from harness.soak import SOAK_DATAPATH, SOAK_EXTRA, VICTIMS, Soak

# Correctness under kills, with retries and no timing asserted: it runs beside
# the kernel tests.
pytestmark = [pytest.mark.privileged, pytest.mark.integration, pytest.mark.beside_kernel]

SECONDS = float(os.environ.get("FLAGELLA_SOAK_SECONDS", "60"))


def test_churn_with_kills_leaks_nothing(cluster: Cluster) -> None:
    cluster.start(services=("ipam", "policy", "lb", "endpoint"), extra=SOAK_EXTRA)
    node = cluster.add_node("soak", extra=SOAK_DATAPATH)
    result = Soak(cluster, node, pods=5, kill_interval=5.0).run(SECONDS)
    figures = result.figures(warm_up=15.0)
    report = dict(figures)
    assert {w.victim for w in result.windows} == set(VICTIMS), report
    assert result.adds >= 20, report
    assert result.add_failures == [], result.add_failures
    assert result.del_failures == [], result.del_failures
    assert result.errors == [], result.errors
    assert result.policy_updates > 10, report
    assert result.service_updates > 10, report
    outside = result.probe_failures_outside_windows()
    assert not outside, (outside, result.windows)
    assert len(result.probes) > 50, report
    assert result.leaks == {}, result.leaks
    assert result.etcd_keys_left == [], result.etcd_keys_left
    # Gross leaks only, at this length: a process that keeps taking a file
    # or 20 MiB a minute.
    for name, value in figures.items():
        if name.startswith("fd_growth_per_min_"):
            assert value < 30, report
        if name.startswith("rss_growth_kib_per_min_"):
            assert value < 20 * 1024, report
