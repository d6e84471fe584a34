"""The shipped Prometheus configurations (deploy/prometheus) and Grafana
dashboard (deploy/grafana): Debian's promtool accepts the compose one and
what scripts/prometheus_config.py makes of it; both name one job per service
at the ports docs/metrics.md gives; every dashboard query reads only
metrics docs/metrics.md lists (tests/e2e/test_prometheus.py checks them
against a real scrape)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from harness.metrics import DOCS
from harness.prometheus import dashboard_queries, documented_ports, metric_names

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "deploy" / "prometheus"
RENDER = ROOT / "scripts" / "prometheus_config.py"
SERVICES = ["ipam", "policy", "endpoint", "lb", "relay", "datapath"]
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RENDER), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_the_compose_configuration_scrapes_each_service_at_its_port_and_promtool_accepts_it(
    tmp_path: Path,
) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/setup installs Debian's prometheus"
    shipped = yaml.safe_load((CONFIGS / "prometheus.yml").read_text())
    ports = documented_ports()
    assert sorted(ports) == sorted(SERVICES)
    assert {
        job["job_name"]: job["static_configs"][0]["targets"] for job in shipped["scrape_configs"]
    } == {svc: [f"{svc}:{ports[svc]}"] for svc in SERVICES}
    check = subprocess.run([promtool, "check", "config", str(CONFIGS / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr

    # scripts/prometheus_config.py: the same jobs at other addresses.
    targets = [
        a for i, svc in enumerate(SERVICES) for a in ("--target", f"{svc}=127.0.0.1:{9 + i}")
    ]
    out = render(*targets, "--scrape-interval", "1s")
    assert out.returncode == 0, out.stderr
    local = yaml.safe_load(out.stdout)
    assert local["global"]["scrape_interval"] == "1s"
    assert [(j["job_name"], j["static_configs"]) for j in local["scrape_configs"]] == [
        (svc, [{"targets": [f"127.0.0.1:{9 + i}"]}]) for i, svc in enumerate(SERVICES)
    ]
    (tmp_path / "local.yml").write_text(out.stdout)
    check = subprocess.run([promtool, "check", "config", str(tmp_path / "local.yml")],
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    # Every job and only those, each with an address.
    missing = render(*targets[:-2])
    assert missing.returncode == 2
    assert "missing ['datapath']" in missing.stderr
    assert "unknown ['web']" in render(*targets, "--target", "web=127.0.0.1:1").stderr
    assert "invalid --target: 'ipam'" in render("--target", "ipam").stderr


def test_the_kubernetes_configuration_keeps_each_services_annotated_pods_at_their_port() -> None:
    """Debian's promtool is built without Kubernetes discovery, so this one
    is checked by its structure (test_k8s_manifests checks the annotations)."""
    config = yaml.safe_load((CONFIGS / "prometheus-kubernetes.yml").read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == SERVICES
    for job in config["scrape_configs"]:
        assert job["kubernetes_sd_configs"] == [
            {"role": "pod", "namespaces": {"names": ["flagella"]}}
        ]
        keep, address, *_ = job["relabel_configs"]
        assert keep["action"] == "keep"
        assert keep["source_labels"] == [
            "__meta_kubernetes_pod_annotation_prometheus_io_scrape",
            "__meta_kubernetes_pod_label_app_kubernetes_io_name",
        ]
        assert keep["regex"] == f"true;{job['job_name']}"
        assert address["target_label"] == "__address__"
        assert address["source_labels"][1] == "__meta_kubernetes_pod_annotation_prometheus_io_port"


def documented_metrics() -> tuple[set[str], set[str]]:
    """(every metric name docs/metrics.md gives, the histograms among them)."""
    text = DOCS.read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| (\w+) \|", text, re.M)
    names = {name for name, _ in rows} | set(re.findall(r"`((?:process|python)_[a-z_]+)`", text))
    return names, {name for name, kind in rows if kind == "histogram"}


def test_every_dashboard_query_reads_only_documented_metrics() -> None:
    names, histograms = documented_metrics()
    queries = dashboard_queries()
    read: set[str] = set()
    for panel, exprs in queries.items():
        for expr in exprs:
            for name in metric_names(expr):
                base = re.sub(r"_(bucket|count|sum)$", "", name)
                assert name in names or (base in histograms and name != base), (panel, name)
                read.add(base)
    # What the dashboard is for.
    assert {
        "flagella_drop_count_total",
        "flagella_forward_count_total",
        "grpc_server_handled_total",
        "grpc_server_handling_seconds",
        "flagella_kvstore_operations_duration_seconds",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
    } <= read
