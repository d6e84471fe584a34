"""Cost of recording map events: CPU time per write of the map layer with
the history on (--map-event-history, 512 by default) and off (0), for
single updates, deletes and batch updates of the backends map of a
private pinned datapath (root; removed at the end).

    python bench/mapevents.py [--json] [--n N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness.bpf import private_datapath

from flagella.datapath.bpf import Datapath, compile_programs
from flagella.datapath.bpf import layout as L


def cpu_ns_per(fn: Callable[[], object], n: int) -> float:
    start = time.process_time_ns()
    fn()
    return (time.process_time_ns() - start) / n


def measure(dp: Datapath, n: int) -> dict[str, float]:
    b = dp.backends
    pairs = [
        (L.U32(i), L.BackendValue(port=L.port_be(80), proto=6, state=1)) for i in range(1, n + 1)
    ]

    def singles() -> None:
        for k, v in pairs:
            b.update(k, v)

    def deletes() -> None:
        for k, _ in pairs:
            b.delete(k)

    out = {
        "update_ns": cpu_ns_per(singles, n),
        "delete_ns": cpu_ns_per(deletes, n),
        "batch_update_ns": cpu_ns_per(lambda: b.update_batch(pairs), n),
    }
    b.clear()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    programs = compile_programs()
    results: dict[str, dict[str, float]] = {}
    with open("/proc/loadavg") as f:
        load_start = f.read().split()[0]
    for history in (0, 512, 0, 512):
        with private_datapath(programs, map_event_history=history) as dp:
            measure(dp, 2000)  # warm-up
            got = measure(dp, args.n)
        best = results.setdefault(f"history_{history}", got)
        for k, v in got.items():
            best[k] = min(best[k], v)
    with open("/proc/loadavg") as f:
        load_end = f.read().split()[0]
    doc = {"load_start": load_start, "load_end": load_end, "n": args.n, **results}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"load {load_start} -> {load_end}; CPU ns per write (best of 2), n={args.n}")
        for name, r in results.items():
            print(f"  {name:<12} " + "  ".join(f"{k} {v:7.0f}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
