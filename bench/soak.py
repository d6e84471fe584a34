"""Churn soak: pods added and deleted through the real `flagella-cni`, policy
and service updates, traffic probes between live pods and through a
ClusterIP, and a kill -9 of a random service every few seconds (restarted at
once), against etcd and the five services as processes. At the end every
pod is deleted: leaked IPs, identity references, ipcache entries, veths, map
entries and etcd keys are counted, and each process's memory and open files
growth per minute is reported.

    python bench/soak.py [--minutes N] [--quick] [--json]

Needs root. Creates its own etcd, processes, network namespaces and pin
folder, and removes them (the engine is tests/harness/soak.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.cluster import standalone_cluster  # noqa: E402
from harness.soak import SOAK_DATAPATH, SOAK_ETCD, SOAK_EXTRA, Soak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to churn")
    parser.add_argument(
        "--quick", action="store_true", help="20 s of churn (under 30 s of churn and set-up)"
    )
    parser.add_argument("--pods", type=int, default=6, help="churned pods kept alive at once")
    parser.add_argument(
        "--kill-interval", type=float, default=5.0, help="mean seconds between kills (0: none)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    seconds = 20.0 if args.quick else args.minutes * 60
    tmp = Path(tempfile.mkdtemp(prefix="flbench-soak-"))
    log = (lambda _: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        with standalone_cluster(tmp, etcd_args=SOAK_ETCD) as cluster:
            cluster.start(services=("ipam", "policy", "lb", "endpoint"), extra=SOAK_EXTRA)
            node = cluster.add_node("soak", extra=SOAK_DATAPATH)
            soak = Soak(cluster, node, pods=args.pods, kill_interval=args.kill_interval, log=log)
            result = soak.run(seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = result.figures(warm_up=min(30.0, seconds / 4))
    # The same over each lifetime's second half only: a process that fills
    # bounded caches grows early and then flattens; a leak keeps its slope.
    for process, (rss, _) in sorted(result.growth_per_minute(seconds / 2).items()):
        figures[f"rss_growth_kib_per_min_second_half_{process}"] = rss
    if args.json:
        print(json.dumps(figures))
        return
    width = max(len(k) for k in figures)
    for name, value in figures.items():
        print(
            f"{name:<{width}}  {value:,.2f}"
            if isinstance(value, float)
            else f"{name:<{width}}  {value}"
        )
    for title, items in (
        ("ADD failures", result.add_failures),
        ("DEL failures", result.del_failures),
        ("errors", result.errors),
        ("etcd keys left", result.etcd_keys_left),
    ):
        if items:
            print(f"\n{title}:", *items[:20], sep="\n  ")
    t0 = min((w.start for w in result.windows), default=0.0)
    outside = result.probe_failures_outside_windows()
    if outside:
        print("\nprobe failures outside kill windows (s from the first kill):")
        for p in outside:
            print(f"  {p.kind} {p.src} -> {p.dst} at {p.start - t0:.1f}-{p.end - t0:.1f}")
        print(
            "kills:",
            ", ".join(f"{w.victim} {w.start - t0:.1f}-{w.end - t0:.1f}" for w in result.windows),
        )
    if result.leaks:
        print("\nleaks:", json.dumps(result.leaks))


if __name__ == "__main__":
    main()
