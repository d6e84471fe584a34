"""Reading a Prometheus scrape in tests, and checking it against
docs/metrics.md (every exported grpc_/flagella_ family documented with its
labels; every other family named)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def documented() -> dict[str, set[str]]:
    """metric name -> its label names, from the tables of docs/metrics.md."""
    out = {}
    for m in re.finditer(r"^\| `([a-z_]+)` \| (\w+) \| ([^|]*) \|", DOCS.read_text(), re.M):
        labels = {x.strip() for x in m.group(3).split(",") if x.strip()}
        out[m.group(1)] = labels
    return out


def check_documented(scrape: str) -> None:
    """Every grpc_ and flagella_ family exported is in docs/metrics.md with
    the same labels; every process metric the docs name is exported."""
    docs = documented()
    text = DOCS.read_text()
    for family in text_string_to_metric_families(scrape):
        name = family.name + ("_total" if family.type == "counter" else "")
        if name.startswith(("grpc_", "flagella_")):
            assert name in docs, f"{name} is not in docs/metrics.md"
            for sample in family.samples:
                labels = set(sample.labels) - {"le"}
                assert labels == docs[name], (name, labels)
        else:
            assert f"`{name}`" in text, f"{name} is not in docs/metrics.md"


def value(scrape: str, name: str, **labels: str) -> float:
    """The sum of name's samples whose labels include labels (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(scrape).items() if n == name and want <= ls)


def histogram_quantile(before: str, after: str, name: str, q: float, **labels: str) -> float:
    """The q-quantile (seconds: the bucket's upper bound, as Prometheus
    bounds it) of what histogram name observed between two scrapes, over
    the series whose labels include labels; 0.0 when it observed nothing."""

    def buckets(scrape: str) -> dict[float, float]:
        want = set(labels.items())
        out: dict[float, float] = {}
        for (n, ls), v in samples(scrape).items():
            if n == f"{name}_bucket" and want <= ls:
                le = float(dict(ls)["le"])
                out[le] = out.get(le, 0.0) + v
        return out

    b0, b1 = buckets(before), buckets(after)
    delta = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return 0.0
    return next(le for le, count in delta if count >= q * total)
