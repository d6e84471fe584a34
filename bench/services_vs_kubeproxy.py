"""ClusterIP services: flagella against kube-proxy's iptables and nftables
modes, side by side in one run, on the same client and backend pods.

For N = 10, 1,000 and 10,000 services (2-4 backends each; --quick: 10 and
1,000), per mode: TCP connect latency p50/p99 (new connections to random
services, one client), connections/s (four clients in parallel, a request
and answer each), time to program all N (flagella: from the first
UpsertServices to the node's BPF services map holding all N; kube-proxy:
its full-sync iptables-restore / nft -f), and time for one change at N
(one backend added to one service) until a connection reaches it.

kube-proxy is recreated as the rules it writes (tests/harness/kubeproxy.py,
which says where the recreation differs); flagella is real etcd, policy,
lb and a node's datapath. Needs root; makes its own network namespaces,
etcd, processes and pin folder and removes them (the engine is
tests/harness/svcbench.py). Usage:

    python bench/services_vs_kubeproxy.py [--quick] [--json] [--plot PNG]
        [--counts 10,1000,10000] [--modes iptables,nftables,flagella]
        [--verdict-events all|enforced|none]

The datapath runs with --verdict-events enforced unless told otherwise (as
Cilium reports policy verdicts: only where a policy is enforced; the bench's
pods have none, so their connections emit no flow event; drops still do).
--verdict-events all is the datapath's default: a flow event at both ends of
every new connection, read by the datapath process (docs/BENCHMARKS.md has
its cost).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.svcbench import run_all  # noqa: E402

MODES = ("iptables", "nftables", "flagella")
ROWS = (
    ("program_s", "program all, s"),
    ("connect_p50_us", "connect p50, µs"),
    ("connect_p99_us", "connect p99, µs"),
    ("connections_per_s", "connections/s"),
    ("change_ms", "one change, ms"),
    ("failed_connections", "failed connections"),
)


def table(r: dict[str, Any], counts: list[int], modes: list[str]) -> str:
    lines = [f"{'figure':<22} {'N':>6} " + " ".join(f"{m:>10}" for m in modes)]
    for key, label in ROWS:
        for n in counts:
            cells = " ".join(f"{r.get(f'{m}_{n}_{key}', '-')!s:>10}" for m in modes)
            lines.append(f"{label:<22} {n:>6} {cells}")
    ratios = [f"{k}: {v}" for k, v in r.items() if k.startswith("ratio_")]
    return "\n".join([*lines, "", *ratios, f"load average: {r['load_average']}"])


def plot(r: dict[str, Any], counts: list[int], modes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        for q, style in (("p50", "-o"), ("p99", "--x")):
            ys = [float(r.get(f"{mode}_{n}_connect_{q}_us", "nan")) for n in counts]
            ax.plot(counts, ys, style, label=f"{mode} {q}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ClusterIP services")
    ax.set_ylabel("TCP connect latency (µs)")
    ax.set_title(f"New connections through services (load average {r['load_average']})")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 and 1,000 services, within ~30 s")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", metavar="PNG", help="draw connect p50/p99 against N into PNG")
    ap.add_argument("--counts", help="service counts, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help="of " + ",".join(MODES))
    ap.add_argument(
        "--verdict-events",
        default="enforced",
        choices=("all", "enforced", "none"),
        help="the datapath's --verdict-events (default: enforced)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces, iptables, BPF)", file=sys.stderr)
        return 2
    default = "10,1000" if args.quick else "10,1000,10000"
    counts = [int(c) for c in (args.counts or default).split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        print(f"unknown modes: {sorted(unknown)}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flagella-bench-svc-") as tmp:
        r = run_all(
            counts,
            samples=300 if args.quick else 2000,
            seconds=1.0 if args.quick else 3.0,
            tmp=Path(tmp),
            modes=modes,
            verdict_events=args.verdict_events,
        )
    r = {"quick": args.quick, **r, "load_average": f"{load0:.1f}-{os.getloadavg()[0]:.1f}"}
    if args.plot:
        plot(r, counts, modes, args.plot)
    print(json.dumps(r) if args.json else table(r, counts, modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
