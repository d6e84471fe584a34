"""Where the CPU of one CNI ADD (and DEL) goes, per process: the
`flagella-cni` plugin, the endpoint, ipam, policy and datapath services, and
etcd, measured from /proc/<pid>/stat (and the children's rusage for the
plugin) around a run of sequential ADDs through the real plugin.

    python bench/cni_profile.py [--n 40] [--py-spy DIR] [--bundle]

With --py-spy DIR, each service is also sampled by py-spy (`pip install
py-spy`) during the ADDs, one flame graph per service in DIR. With --bundle, the plugin is the
self-contained bundle the datapath image installs on nodes (built first),
not the venv's script. Needs root.
Creates its own etcd, processes, network namespaces and pin folder, and
removes them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.cluster import standalone_cluster  # noqa: E402
from harness.cni import build_bundle, cni, netconf  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, which: str = "all") -> float:
    """CPU seconds of a process and its threads: user, system or both."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    user, system = int(fields[11]), int(fields[12])
    return {"user": user, "system": system, "all": user + system}[which] / TICK


def etcd_requests(metrics_url: str) -> dict[str, float]:
    """gRPC requests etcd has handled, by method (its /metrics)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{"):
            labels, _, value = line.rpartition(" ")
            method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
            out[method] = out.get(method, 0.0) + float(value)
    return out


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def start_spies(out_dir: Path, command: str, pids: dict[str, int]) -> list[subprocess.Popen[bytes]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spies = [
        subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(pids[name]),
                "--rate",
                "500",
                "--format",
                "raw",
                "--output",
                str(out_dir / f"{command.lower()}-{name}.txt"),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in ("endpoint", "ipam", "policy", "datapath")
    ]
    time.sleep(1.0)  # attached
    return spies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40, help="ADDs (and DELs) to measure")
    ap.add_argument("--py-spy", metavar="DIR", help="also record a py-spy flame graph per service")
    ap.add_argument(
        "--parallel", type=int, default=1, help="ADDs (and DELs) in flight at once (default 1)"
    )
    ap.add_argument("--bundle", action="store_true", help="run the plugin's node bundle")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/cni_profile.py needs root", file=sys.stderr)
        return 2
    n = args.n
    tmp = Path(tempfile.mkdtemp(prefix="flbench-cniprof-"))
    if args.bundle:
        os.environ["FLAGELLA_CNI_PLUGIN"] = build_bundle(tmp / "bundle")
    with standalone_cluster(tmp, log_level="info") as cluster:
        cluster.start(services=("ipam", "policy", "lb", "endpoint"))
        node = cluster.add_node("prof")
        conf = netconf(node.cni_socket, {"app": "prof"})
        pods = [cluster.pod(node, f"p{i}") for i in range(n + 1)]
        assert node.process is not None
        assert cluster.etcd.proc is not None
        pids = {
            "endpoint": cluster.services["endpoint"].pid,
            "ipam": cluster.services["ipam"].pid,
            "policy": cluster.services["policy"].pid,
            "datapath": node.process.pid,
            "lb": cluster.services["lb"].pid,
            "etcd": cluster.etcd.proc.pid,
        }

        def run(command: str, i: int) -> float:
            t = time.perf_counter()
            rc, out = cni(
                command,
                conf,
                container_id=f"prof-{i}",
                netns=pods[i].path if command == "ADD" else "",
                pod=("prof", f"p{i}") if command == "ADD" else None,
            )
            if rc != 0:
                raise RuntimeError(f"{command} {i}: {out}")
            return (time.perf_counter() - t) * 1000

        # Warm-up (identity, policy, caches, the services' channels), retried
        # on code 11 as a runtime retries: on a loaded machine the first call
        # may find a channel not connected yet.
        for attempt in range(5):
            try:
                run("ADD", n)
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                run("DEL", n)
        run("DEL", n)
        out_dir = Path(args.py_spy) if args.py_spy else None
        for command in ("ADD", "DEL"):
            # py-spy samples one command at a time, each into its own files.
            spies = start_spies(out_dir, command, pids) if out_dir else []
            before = {name: cpu_s(pid) for name, pid in pids.items()}
            system_before = {name: cpu_s(pid, "system") for name, pid in pids.items()}
            plugin_before = children_cpu_s()
            driver_before = self_cpu_s()
            etcd_before = etcd_requests(cluster.etcd.metrics_url)
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
                wall = list(pool.map(lambda i, c=command: run(c, i), range(n)))
            rate = n / (time.perf_counter() - t0)
            plugin = children_cpu_s() - plugin_before
            driver = self_cpu_s() - driver_before
            etcd_after = etcd_requests(cluster.etcd.metrics_url)
            after = {name: cpu_s(pid) for name, pid in pids.items()}
            system = {
                name: (cpu_s(pid, "system") - system_before[name]) / n * 1000
                for name, pid in pids.items()
            }
            for spy in spies:
                spy.send_signal(signal.SIGINT)
            for spy in spies:
                spy.wait(30)
            per = {name: (after[name] - before[name]) / n * 1000 for name in pids}
            per["plugin"] = plugin / n * 1000
            per["driver (this script)"] = driver / n * 1000
            print(
                f"{command}: wall p50 {statistics.median(wall):.1f} ms over {n}, "
                f"{args.parallel} in parallel: {rate:.1f}/s"
            )
            print(f"  CPU ms per {command}: " + ", ".join(f"{k} {v:.1f}" for k, v in per.items()))
            print(f"  total {sum(per.values()):.1f} ms")
            print(
                "  of which in the kernel: " + ", ".join(f"{k} {v:.1f}" for k, v in system.items())
            )
            calls = {
                m: (etcd_after[m] - etcd_before.get(m, 0.0)) / n
                for m in etcd_after
                if etcd_after[m] > etcd_before.get(m, 0.0)
            }
            print(
                f"  etcd requests per {command}: "
                + ", ".join(f"{m} {c:.1f}" for m, c in sorted(calls.items()))
            )
        # The plugin's CPU that is its start (the interpreter, its imports):
        # VERSION, which it answers without the socket.
        plugin_before = children_cpu_s()
        for _ in range(n):
            if cni("VERSION", conf)[0] != 0:
                raise RuntimeError("VERSION failed")
        start = (children_cpu_s() - plugin_before) / n * 1000
        print(f"plugin start alone (VERSION, no socket): {start:.1f} ms of CPU per run")
        # The endpoint service's own step timings ("endpoint ready" lines).
        steps: dict[str, list[float]] = {}
        for line in cluster.services["endpoint"].logs().splitlines():
            entry = json.loads(line) if line.startswith("{") else {}
            if entry.get("msg") == "endpoint ready" and entry.get("container") != f"prof-{n}":
                for step, ms in entry.get("took_ms", {}).items():
                    steps.setdefault(step, []).append(ms)
        print(
            "CreateEndpoint steps, p50 ms: "
            + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in steps.items())
        )
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
