"""Fan-out to many nodes: real etcd and control plane (ipam, policy, lb,
endpoint, mutual TLS as deployed) and N node subscribers, light processes
each running many nodes with their own node certificate, registered in the
node registry and following every stream a datapath follows. For each N:
the delay from a write until every node has it (p50/p99/max over every
node and change) for a policy rule change, a service change and a new
endpoint's ipcache entry; CPU and RSS of each control-plane process, etcd
and the node processes at rest and during the changes; etcd requests per
node per minute at rest (etcd's own metrics).

    python bench/fanout.py [--nodes 200,1000] [--quick] [--json]
        [--rest-seconds 60] [--changes 10] [--plot PNG]

Makes its own etcd, processes and certificates and removes them (the
engine is tests/harness/fanout.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.cluster import standalone_cluster  # noqa: E402
from harness.fanout import FANOUT_EXTRA, KINDS, Fanout, Round, figures  # noqa: E402

PROCESSES = ("ipam", "policy", "lb", "endpoint", "etcd", "nodes")


def table(r: dict[str, Any], counts: list[int]) -> str:
    head = f"{'figure':<34}" + "".join(f"{f'N={n}':>12}" for n in counts)
    lines = [head]

    def row(label: str, key: str) -> None:
        cells = "".join(f"{r.get(f'n{n}_{key}', '-')!s:>12}" for n in counts)
        lines.append(f"{label:<34}{cells}")

    for kind in KINDS:
        for q in ("p50", "p99", "max"):
            row(f"{kind} converged {q}, ms", f"{kind}_{q}_ms")
    for who in PROCESSES:
        row(f"{who} CPU at rest, %", f"{who}_rest_cpu_pct")
        for kind in KINDS:
            row(f"{who} CPU per {kind} change, ms", f"{who}_cpu_ms_per_{kind}_change")
        row(f"{who} RSS at rest, MiB", f"{who}_rest_rss_mib")
        row(f"{who} RSS after changes, MiB", f"{who}_changes_rss_mib")
    row("etcd RPCs/node/min at rest", "etcd_started_per_node_per_min")
    row("etcd messages/node/min at rest", "etcd_msg_received_per_node_per_min")
    prefix = "etcd_msg_received_"
    methods = sorted(
        {
            k.split(prefix, 1)[1]
            for k in r
            if prefix in k and not k.endswith(f"{prefix}per_node_per_min")
        }
    )
    for m in methods:
        row(f"  of which {m.removesuffix('_per_node_per_min')}", prefix + m)
    row("load average at start", "loadavg_start")
    row("load average at end", "loadavg_end")
    return "\n".join(lines)


def plot(rounds: list[Round], r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [x.nodes for x in rounds]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in KINDS:
        for q, style in (("p50", "-o"), ("p99", "--x")):
            ax.plot(counts, [r[f"n{n}_{kind}_{q}_ms"] for n in counts], style, label=f"{kind} {q}")
    ax.axhline(1000, color="grey", linewidth=0.8, linestyle=":", label="target p99 (1 s)")
    ax.set_xlabel("node subscribers")
    ax.set_ylabel("write to every node, ms")
    load = ", ".join(f"N={n}: {r[f'n{n}_loadavg_start'].split()[0]}" for n in counts)
    ax.set_title(f"Fan-out convergence (load average at start {load})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="200,1000", help="node counts, comma-separated")
    ap.add_argument("--quick", action="store_true", help="50 nodes, within ~30 s")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rest-seconds", type=float, default=60.0, help="the quiet window")
    ap.add_argument("--changes", type=int, default=10, help="changes of each kind per N")
    ap.add_argument("--per-worker", type=int, default=125, help="nodes per node process")
    ap.add_argument("--plot", metavar="PNG", help="draw convergence against N into PNG")
    args = ap.parse_args()
    counts = [50] if args.quick else sorted(int(n) for n in args.nodes.split(","))
    rest = 5.0 if args.quick else args.rest_seconds
    changes = 3 if args.quick else args.changes
    log = (lambda _: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    tmp = Path(tempfile.mkdtemp(prefix="flbench-fanout-"))
    rounds: list[Round] = []
    codes: list[int] = []
    error = ""
    try:
        with standalone_cluster(tmp) as cluster:
            cluster.start(services=("ipam", "policy", "lb", "endpoint"), extra=FANOUT_EXTRA)
            fanout = Fanout(cluster, tmp, per_worker=args.per_worker, log=log)
            try:
                for n in counts:
                    fanout.grow(n)
                    rounds.append(fanout.measure(changes, rest))
            except (TimeoutError, RuntimeError, grpc.RpcError) as exc:
                # The rounds measured so far still count; the failure is reported.
                error = f"at {n} nodes: {str(exc)[:300]}"
            finally:
                codes = fanout.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r = {"quick": args.quick, **figures(rounds), "node_process_exit_codes": codes}
    if error:
        r["error"] = error
    counts = [x.nodes for x in rounds]
    if args.plot and rounds:
        plot(rounds, r, args.plot)
    print(json.dumps(r) if args.json else table(r, counts) + (f"\nerror: {error}" if error else ""))
    return 0 if not any(codes) and not error else 1


if __name__ == "__main__":
    sys.exit(main())
