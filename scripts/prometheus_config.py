#!/usr/bin/env python3
"""Print the shipped Prometheus configuration with other targets.

    scripts/prometheus_config.py --target ipam=127.0.0.1:9961 ... [--scrape-interval 1s]

Reads deploy/prometheus/prometheus.yml (compose's: one job per service) and
replaces each job's static targets with the one given for it; every job
must be given one, and only those jobs. scripts/up writes its configuration
this way (the services on loopback), and so do the tests (their ports).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "prometheus.yml"


def render(
    shipped: dict[str, Any], targets: dict[str, str], interval: str | None
) -> dict[str, Any]:
    jobs = {job["job_name"] for job in shipped["scrape_configs"]}
    if set(targets) != jobs:
        missing, unknown = sorted(jobs - set(targets)), sorted(set(targets) - jobs)
        raise ValueError(f"--target: jobs are {sorted(jobs)}; missing {missing}, unknown {unknown}")
    out = dict(shipped)
    if interval:
        out["global"] = {
            **shipped.get("global", {}),
            "scrape_interval": interval,
            "evaluation_interval": interval,
        }
    out["scrape_configs"] = [
        {**job, "static_configs": [{"targets": [targets[job["job_name"]]]}]}
        for job in shipped["scrape_configs"]
    ]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/prometheus_config.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=SHIPPED, help="default: %(default)s")
    parser.add_argument("--target", action="append", default=[], metavar="JOB=HOST:PORT")
    parser.add_argument("--scrape-interval", help="e.g. 1s (default: the shipped one)")
    args = parser.parse_args(argv)
    targets: dict[str, str] = {}
    for item in args.target:
        job, sep, address = item.partition("=")
        if not sep or not job or ":" not in address:
            parser.error(f"invalid --target: {item!r} (want JOB=HOST:PORT)")
        targets[job] = address
    try:
        out = render(yaml.safe_load(args.config.read_text()), targets, args.scrape_interval)
    except ValueError as e:
        parser.error(str(e))
    yaml.safe_dump(out, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
