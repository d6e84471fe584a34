"""bench/services_vs_kubeproxy.py's core at a tiny size, so the benchmark
cannot rot: each mode (kube-proxy's iptables and nftables rules, flagella's
real control plane and datapath) serves 6 services to the same pods, every
figure comes out sane, every connection reached a backend of its service,
the one change took effect, and nothing is left behind (netns, chains,
tables, BPF pin folders)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.svcbench import run_all

# Its own namespaces, rules and pins; only sane figures asserted: it runs
# beside the kernel tests.
pytestmark = [pytest.mark.privileged, pytest.mark.integration, pytest.mark.beside_kernel]

MODES = ("iptables", "nftables", "flagella")


def test_each_mode_serves_measures_and_cleans_up(tmp_path: Path) -> None:
    r = run_all([6], samples=40, seconds=0.3, tmp=tmp_path, modes=MODES, pod_counts=(2, 3))
    for mode in MODES:
        assert r[f"{mode}_6_connect_samples"] == 40, r
        assert 0 < r[f"{mode}_6_connect_p50_us"] <= r[f"{mode}_6_connect_p99_us"], r
        assert r[f"{mode}_6_connections_per_s"] > 10, r
        assert r[f"{mode}_6_failed_connections"] == 0, r
        assert r[f"{mode}_6_wrong_backend_answers"] == 0, r
        assert 0 < r[f"{mode}_6_program_s"] < 60, r
        assert r[f"{mode}_6_change_ms"] is not None, r
    assert r["iptables_rules_left_after_cleanup"] == 0, r
    assert r["nftables_rules_left_after_cleanup"] == 0, r
    assert r["netns_left"] == 0, r
    assert r["bpf_pins_left"] == 0, r
    for peer in ("iptables", "nftables"):
        assert r[f"ratio_flagella_vs_{peer}_6_connect_p50"] > 0, r
