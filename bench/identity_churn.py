"""Identity churn (issue 19 item 3; Cilium #34512, GC falling behind churn):
hold 50,000 identities, then create and delete pods with unique labels at
100/s, so that every new pod needs a new identity and every deleted one
leaves garbage. Reports allocation latency, identities in use and garbage
sampled every second, GC rounds, etcd keys, and the policy process's CPU
and memory; then waits for the GC to free every churned identity.

Starts its own etcd and policy process on free loopback ports and stops them
by PID at the end (the engine is tests/harness/idchurn.py). With
FLAGELLA_CHURN_PROFILE=<file>, the policy process runs under cProfile and
writes its profile there at exit.

    python bench/identity_churn.py [--quick] [--json] [--held N] [--rate R] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.etcd import EtcdServer  # noqa: E402
from harness.idchurn import IdentityChurn  # noqa: E402
from harness.procs import ServiceProcess  # noqa: E402

TARGET_P99_MS = 50.0

#: With FLAGELLA_CHURN_PROFILE: a sitecustomize profiling the whole process,
#: written at its exit (the service returns from SIGTERM).
PROFILED = """
import atexit, cProfile, os
_profiler = cProfile.Profile()
_profiler.enable()
atexit.register(lambda: _profiler.dump_stats(os.environ["FLAGELLA_CHURN_PROFILE"]))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="2,000 held, 10 s, GC every 2 s (about 30 s)"
    )
    parser.add_argument("--held", type=int, help="identities held throughout (50,000)")
    parser.add_argument("--rate", type=float, default=100.0, help="pods created (and deleted) /s")
    parser.add_argument("--seconds", type=float, help="seconds of churn (120)")
    parser.add_argument("--lifetime", type=float, default=2.0, help="seconds each pod lives")
    parser.add_argument(
        "--gc-interval", type=float, help="the service's --identity-gc-interval (its default)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    held = args.held if args.held is not None else (2_000 if args.quick else 50_000)
    if args.quick and args.gc_interval is None:
        args.gc_interval = 2.0  # (rounds within the 10 s, and a short drain)
    seconds = args.seconds if args.seconds is not None else (10.0 if args.quick else 120.0)
    flags = ["--log-level", "warning"]
    if args.gc_interval is not None:
        flags += ["--identity-gc-interval", str(args.gc_interval)]
    env, site = {}, None
    if os.environ.get("FLAGELLA_CHURN_PROFILE"):
        site = Path(tempfile.mkdtemp(prefix="flbench-churn-"))
        (site / "sitecustomize.py").write_text(PROFILED)
        env["PYTHONPATH"] = f"{site}:{os.environ.get('PYTHONPATH', '')}"
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    started = time.perf_counter()
    etcd = EtcdServer().start()
    proc = ServiceProcess(
        "policy",
        ["--etcd-endpoints", etcd.endpoint, *flags],
        env=env,
    )
    try:
        proc.start().wait_serving()
        churn = IdentityChurn(proc, etcd)

        async def run() -> None:
            await churn.run(held, args.rate, seconds, args.lifetime)
            await churn.drain(timeout=max(30.0, 3 * (args.gc_interval or 15.0)))

        asyncio.run(run())
    finally:
        proc.cleanup()
        etcd.cleanup()
        if site is not None:
            shutil.rmtree(site, ignore_errors=True)
    figures = churn.result.figures()
    figures.update(
        rate_per_s=args.rate,
        churn_s=seconds,
        pod_lifetime_s=args.lifetime,
        gc_interval_s=args.gc_interval,
        load_average_start=" ".join(load_start),
        load_average_end=" ".join(Path("/proc/loadavg").read_text().split()[:3]),
        total_s=round(time.perf_counter() - started, 1),
    )
    if args.json:
        print(json.dumps(figures))
        return 0
    width = max(len(k) for k in figures)
    for name, fig in figures.items():
        print(
            f"{name:<{width}}  {fig:,}"
            if isinstance(fig, int | float)
            else f"{name:<{width}}  {fig}"
        )
    print(f"\nallocation p99 target < {TARGET_P99_MS:g} ms:", end=" ")
    print("met" if figures["allocate_p99_ms"] < TARGET_P99_MS else "MISSED")
    print("\nsecond  identities  in use  garbage  gc rounds")
    for s in churn.result.samples:
        print(
            f"{s.t:6.0f}  {s.global_identities:10,}  {s.in_use:6,}  {s.unreferenced:7,}  {s.gc_runs:9}"
        )
    for title, items in (
        ("errors", churn.result.errors),
        ("in-use identities lost", churn.result.lost),
    ):
        if items:
            print(f"\n{title}:", *items[:20], sep="\n  ")
    return 1 if churn.result.lost else 0


if __name__ == "__main__":
    sys.exit(main())
