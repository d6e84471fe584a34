"""Maglev tables: properties (hypothesis) and determinism across processes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flagella.lb.maglev import (
    DEFAULT_SEED,
    SUPPORTED_SIZES,
    MaglevBackend,
    backend_key,
    check_size,
    lookup_table,
    parse_seed,
    slot_counts,
    turn_counts,
    turn_order,
)
from flagella.lb.model import (
    Algorithm,
    Backend,
    BackendState,
    Frontend,
    Protocol,
    ServiceRecord,
    ServiceType,
    Source,
)

SEED = parse_seed(DEFAULT_SEED)
SMALL_SIZES = [s for s in SUPPORTED_SIZES if s <= 4093]

addresses = st.tuples(
    st.integers(0, 255), st.integers(0, 255), st.integers(0, 255), st.integers(1, 254)
).map(lambda t: f"10.{t[1]}.{t[2]}.{t[3]}")


@st.composite
def backend_sets(
    draw: st.DrawFn, max_n: int = 40, weighted: bool | None = None
) -> list[MaglevBackend]:
    n = draw(st.integers(1, max_n))
    keys = draw(
        st.lists(st.tuples(addresses, st.integers(1, 65535)), min_size=n, max_size=n, unique=True)
    )
    use_weights = draw(st.booleans()) if weighted is None else weighted
    weights = (
        draw(st.lists(st.integers(1, 100), min_size=n, max_size=n)) if use_weights else [1] * n
    )
    return [
        MaglevBackend(backend_key(a, p, "TCP"), 1000 + i, w)
        for i, ((a, p), w) in enumerate(zip(keys, weights, strict=True))
    ]


def moved(before: list[int], after: list[int]) -> int:
    return sum(1 for a, b in zip(before, after, strict=True) if a != b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backends=backend_sets(), m=st.sampled_from(SMALL_SIZES))
def test_every_slot_filled_with_exact_weight_shares(backends: list[MaglevBackend], m: int) -> None:
    table = lookup_table(backends, m, SEED)
    assert len(table) == m
    ids = {b.id for b in backends}
    assert set(table) <= ids  # every slot holds one of the backends
    counts = slot_counts(table)
    total_weight = sum(b.weight for b in backends)
    for b in backends:
        share = counts.get(b.id, 0) / m
        want = b.weight / total_weight
        assert abs(share - want) <= 0.01, (b, share, want)
        # In fact within one slot of the exact share.
        assert abs(counts.get(b.id, 0) - m * want) < 1


@settings(max_examples=40, deadline=None)
@given(backends=backend_sets(max_n=20), m=st.sampled_from(SMALL_SIZES), seed=st.randoms())
def test_table_independent_of_input_order(
    backends: list[MaglevBackend], m: int, seed: random.Random
) -> None:
    shuffled = list(backends)
    seed.shuffle(shuffled)
    assert lookup_table(shuffled, m, SEED) == lookup_table(backends, m, SEED)


def disruption(
    backends: list[MaglevBackend], m: int, gone: MaglevBackend, extra: MaglevBackend
) -> tuple[float, float]:
    """Slots moved beyond the minimum, as a fraction of M, when `gone` is
    removed and when `extra` is added. The minimum is the slots of the
    removed backend (they must move) or of the added one (it must take some);
    anything more moved between backends that stayed. (Naive modulo hashing
    would move about (N-1)/N of all slots.)"""
    before = lookup_table(backends, m, SEED)
    after = lookup_table([b for b in backends if b is not gone], m, SEED)
    assert gone.id not in after
    removal = moved(before, after) - before.count(gone.id)
    grown = lookup_table([*backends, extra], m, SEED)
    addition = moved(before, grown) - grown.count(extra.id)
    assert removal >= 0
    assert addition >= 0
    return removal / m, addition / m


EXTRA = MaglevBackend(backend_key("192.168.77.7", 4242, "TCP"), 99, 5)


# derandomize: the bound is statistical (Maglev has rare worse cases, see
# docs/lb.md), so the examples are fixed rather than new on every run.
@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data(), m=st.sampled_from([1021, 2039, 4093]))
def test_disruption_on_removal_and_addition_is_bounded(data: st.DataObject, m: int) -> None:
    """With M >= 100 N (Cilium's guidance), one removal or addition moves the
    minimum plus at most a modest share of the table."""
    backends = data.draw(backend_sets(max_n=m // 100))
    if len(backends) < 2:
        backends.append(MaglevBackend(backend_key("192.168.77.8", 4242, "TCP"), 98, 1))
    gone = data.draw(st.sampled_from(backends))
    removal, addition = disruption(backends, m, gone, EXTRA)
    assert removal <= 0.30
    assert addition <= 0.30


def test_disruption_is_close_to_the_minimum_on_average() -> None:
    """Over 100 random services (200 changes) (1 to M/100 backends, half of them weighted),
    the slots moved beyond the minimum average under 2% of the table, and
    95% of changes stay under 4.5%."""
    rnd = random.Random(11)
    samples: list[float] = []
    for _ in range(100):
        m = rnd.choice([1021, 2039])
        n = rnd.randint(2, m // 100)
        weighted = rnd.random() < 0.5
        backends = [
            MaglevBackend(
                backend_key(
                    f"10.{rnd.randrange(256)}.{rnd.randrange(256)}.{rnd.randrange(1, 255)}",
                    rnd.randrange(1, 65536),
                    "TCP",
                ),
                1000 + i,
                rnd.randint(1, 100) if weighted else 1,
            )
            for i in range(n)
        ]
        samples.extend(disruption(backends, m, rnd.choice(backends), EXTRA))
    samples.sort()
    assert sum(samples) / len(samples) < 0.02, samples[-10:]
    assert samples[int(len(samples) * 0.95)] < 0.045, samples[-10:]


def test_disruption_with_100_backends_at_the_default_and_large_sizes() -> None:
    """Removals from 100 backends: beyond the minimum 1% that must move,
    about 1.5% more at M=16,381 and well under 1% at M=65,521."""
    rnd = random.Random(1)
    for m, bound in ((16381, 0.025), (65521, 0.012)):
        backends = [
            MaglevBackend(backend_key(f"10.2.{i // 250}.{i % 250 + 1}", 8080, "TCP"), 1 + i)
            for i in range(100)
        ]
        before = lookup_table(backends, m, SEED)
        extra = []
        for gone in rnd.sample(backends, 5):
            after = lookup_table([b for b in backends if b is not gone], m, SEED)
            extra.append((moved(before, after) - before.count(gone.id)) / m)
        assert sum(extra) / len(extra) <= bound, extra


def test_no_active_backend_gives_a_table_of_zeros() -> None:
    assert lookup_table([], 251, SEED) == [0] * 251


def test_only_active_backends_get_slots() -> None:
    states = [
        BackendState.ACTIVE,
        BackendState.TERMINATING,
        BackendState.ACTIVE,
        BackendState.QUARANTINED,
        BackendState.MAINTENANCE,
        BackendState.ACTIVE,
    ]
    record = ServiceRecord(
        name="ns/svc",
        namespace="ns",
        id=1,
        rev_nat_id=1,
        frontend=Frontend("10.96.0.1", 80, Protocol.TCP),
        type=ServiceType.CLUSTER_IP,
        node_port=0,
        backends=tuple(
            Backend(100 + i, f"10.0.0.{i + 1}", 8080, 1, s) for i, s in enumerate(states)
        ),
        algorithm=Algorithm.MAGLEV,
        maglev_table_size=1021,
        affinity=None,
        source_ranges=(),
        source=Source.API,
    )
    assert [b.id for b in record.maglev_backends()] == [100, 102, 105]
    table = lookup_table(record.maglev_backends(), 1021, SEED)
    assert set(table) == {100, 102, 105}


def test_weights_change_turns_not_preference() -> None:
    assert turn_counts([1, 1, 2], 251) == [63, 63, 125]
    assert sum(turn_counts([3, 7, 11, 100], 16381)) == 16381
    order = turn_order([1, 3], 8)
    assert sorted(order) == [0, 0, 1, 1, 1, 1, 1, 1]
    # Spread, not bunched: backend 0's two turns are apart.
    first, second = (i for i, b in enumerate(order) if b == 0)
    assert second - first >= 3


def test_seed_changes_the_table() -> None:
    backends = [MaglevBackend(backend_key(f"10.0.0.{i}", 80, "TCP"), i) for i in range(1, 11)]
    other = parse_seed("AAAAAAAAAAAAAAAA")
    assert lookup_table(backends, 1021, SEED) != lookup_table(backends, 1021, other)


def test_seed_and_size_checks() -> None:
    assert len(parse_seed(DEFAULT_SEED)) == 12
    with pytest.raises(ValueError, match="not base64"):
        parse_seed("not base64!")
    with pytest.raises(ValueError, match="not 12"):
        parse_seed("AAAA")
    for m in SUPPORTED_SIZES:
        assert check_size(m) == m
    with pytest.raises(ValueError, match="supported"):
        check_size(16383)


_CHILD = """
import hashlib, json, sys
from flagella.lb.maglev import MaglevBackend, lookup_table, parse_seed
spec = json.loads(sys.stdin.read())
backends = [MaglevBackend(k, i, w) for k, i, w in spec["backends"]]
table = lookup_table(backends, spec["m"], parse_seed(spec["seed"]))
print(hashlib.sha256(json.dumps(table).encode()).hexdigest())
"""


def test_same_table_in_two_separate_processes() -> None:
    rnd = random.Random(3)
    backends = [
        (backend_key(f"10.9.{i}.{rnd.randrange(1, 255)}", rnd.randrange(1, 65535), "TCP"), i, w)
        for i, w in enumerate(rnd.randint(1, 100) for _ in range(100))
    ]
    spec = {"backends": backends, "m": 16381, "seed": DEFAULT_SEED}
    digests = set()
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        digests.add(out.stdout.strip())
    here = lookup_table([MaglevBackend(k, i, w) for k, i, w in backends], 16381, SEED)
    digests.add(hashlib.sha256(json.dumps(here).encode()).hexdigest())
    assert len(digests) == 1


def test_ipv6_key_is_bracketed() -> None:
    assert backend_key("fd00::1", 80, "UDP") == "[fd00::1]:80/UDP"
    assert backend_key("10.0.0.1", 80, "TCP") == "10.0.0.1:80/TCP"
