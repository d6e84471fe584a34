"""A real Prometheus (Debian's /usr/bin/prometheus) for tests: started by PID
on a free port with a temp storage folder, configured from the shipped
deploy/prometheus/prometheus.yml (scripts/prometheus_config.py: same jobs, the
test's targets), read through its HTTP API. And the metric names a PromQL
expression reads (the dashboard's queries are checked with it)."""

from __future__ import annotations

import ipaddress
import json
import random
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.net import free_port
from harness.netns import Netns, run

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = "/usr/bin/prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "flagella.json"
DOCS = ROOT / "docs" / "metrics.md"


def documented_ports() -> dict[str, int]:
    """service -> the port of its default --metrics-listen (docs/metrics.md)."""
    found = re.findall(r"^\| (\w+) \| `127\.0\.0\.1:(\d+)`", DOCS.read_text(), re.M)
    return {svc: int(port) for svc, port in found}


class PrometheusServer:
    def __init__(self, tmp: Path, targets: Mapping[str, str], interval: str = "1s") -> None:
        self.dir = tmp / "prometheus"
        self.targets = dict(targets)
        self.interval = interval
        self.address = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "prometheus.yml"
        args = [a for job, t in self.targets.items() for a in ("--target", f"{job}={t}")]
        rendered = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "prometheus_config.py"), *args,
             "--scrape-interval", self.interval],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        config.write_text(rendered.stdout)
        with (self.dir / "prometheus.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address={self.address}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        path = self.dir / "prometheus.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """The `data` of GET /api/v1/<path>."""
        url = f"http://{self.address}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def health(self) -> dict[str, str]:
        """job -> health of its (one) active target: up, down or unknown."""
        return {t["labels"]["job"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant vector: (labels, value) of each series."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def value(self, expr: str) -> float:
        """The sum of expr's series (0 when it has none)."""
        return sum(v for _, v in self.query(expr))

    def names(self) -> set[str]:
        """Every metric name Prometheus has stored."""
        return set(self.api("label/__name__/values"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class MetricsLink:
    """A veth from this host's network namespace into a node netns, a /30 of
    198.18.0.0/15 (benchmarking space, no route elsewhere): how a Prometheus
    on the host reaches a datapath whose netns has no other way here. Only
    the two ends' addresses; deleting the host end removes the pair."""

    def __init__(self, node_ns: Netns) -> None:
        self.host_if = f"fm{random.randrange(16**6):06x}"
        used = run("ip", "-4", "route", "show", "table", "all").stdout
        taken = [
            ipaddress.IPv4Network(w, strict=False)
            for w in re.findall(r"(?:^|\s)(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", used)
        ]
        space = list(ipaddress.IPv4Network("198.18.0.0/15").subnets(new_prefix=30))
        self.net = next(
            n for n in random.sample(space, 64) if not any(n.overlaps(t) for t in taken)
        )
        host, node = list(self.net.hosts())
        self.host_ip, self.node_ip = str(host), str(node)
        run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "mon0",
            "netns", node_ns.name)  # fmt: skip
        run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        node_ns.ip("addr", "add", f"{self.node_ip}/30", "dev", "mon0")
        node_ns.ip("link", "set", "mon0", "up")

    def cleanup(self) -> None:
        run("ip", "link", "del", self.host_if, check=False)


# --- the metric names of PromQL expressions ---

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "atan2",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# Whole identifiers only (no backing off `rate` to `rat` before its `(`).
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:]|\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names expr reads: identifiers not followed by `(`, once
    strings, label matchers, ranges and grouping label lists are gone, that
    are no PromQL keyword (numbers and $variables are not identifiers)."""
    expr = _STRING.sub('""', expr)
    expr = _MATCHERS.sub("", expr)
    expr = _RANGE.sub("", expr)
    expr = _GROUPING.sub("", expr)
    return {m for m in _IDENT.findall(expr) if m.lower() not in PROMQL_KEYWORDS}


def dashboard_queries(path: Path = DASHBOARD) -> dict[str, list[str]]:
    """panel title -> its targets' expressions."""
    out: dict[str, list[str]] = {}
    for panel in json.loads(path.read_text())["panels"]:
        exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        if exprs:
            out[panel["title"]] = exprs
    return out
