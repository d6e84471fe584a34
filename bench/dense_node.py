"""A dense node (issue 19 item 4): 250 endpoints on one node's real datapath
through SetupEndpoint (as the endpoint service sets a pod up), SetupEndpoint
p50/p99; then one rule selecting all 250 (every pod takes TCP 8080 from
every other: the namespace-isolation pattern), and the time from its write
until every endpoint's policy map has it (target <= 1 s), checked in the
map itself afterwards.

Needs root. Starts its own etcd, policy service, node netns and datapath,
and removes them (the engine is tests/harness/dense.py).

    python bench/dense_node.py [--quick] [--json] [--endpoints N] [--apps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import dense  # noqa: E402
from harness.cluster import standalone_cluster  # noqa: E402

TARGET_MS = 1000.0


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 endpoints (under 30 s)")
    parser.add_argument("--endpoints", type=int, help="endpoints on the node (250)")
    parser.add_argument(
        "--apps", type=int, help="distinct label sets among them (default: one per endpoint)"
    )
    parser.add_argument("--parallel", type=int, default=4, help="ADDs at once")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    count = args.endpoints or (30 if args.quick else 250)
    apps = args.apps or count
    load_start = loadavg()
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="flbench-dense-"))
    try:
        with standalone_cluster(tmp) as cluster:
            cluster.start(services=("policy",))
            node = cluster.add_node("dense")
            result = dense.run(cluster, node, count, apps, args.parallel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = result.figures()
    figures.update(
        load_average_start=load_start,
        load_average_end=loadavg(),
        total_s=round(time.perf_counter() - started, 1),
    )
    if args.json:
        print(json.dumps(figures))
    else:
        width = max(len(k) for k in figures)
        for name, value in figures.items():
            text = f"{value:,}" if isinstance(value, int | float) else value
            print(f"{name:<{width}}  {text}")
        verdict = "met" if result.rule_to_all_ms <= TARGET_MS else "MISSED"
        print(f"\nrule to every endpoint's map <= {TARGET_MS:g} ms: {verdict}")
        if result.missing:
            print("endpoints missing the rule:", *result.missing[:20], sep="\n  ")
    return 1 if result.missing else 0


if __name__ == "__main__":
    sys.exit(main())
