"""Maglev consistent hashing (Eisenbud et al., NSDI 2016) as Cilium uses it
for its kube-proxy replacement, in pure Python.

A table has M slots (M prime, one of SUPPORTED_SIZES); each slot holds the id
of the backend that new flows hashing to it go to. Each backend has a
permutation of the slots, (offset + j * skip) mod M for j = 0, 1, ..., with
offset and skip taken from a keyed hash (BLAKE2b keyed with the cluster's
12-byte seed) of the backend's key "address:port/protocol", so every node
and every lb replica computes the same table from the same input. Backends
take turns; on its turn a backend takes the next slot of its permutation
that is still empty.

Semantics shared with Cilium:
- the table depends only on the set of (key, id, weight) of the active
  backends, never on their order: backends are sorted by key first;
- weights change how many turns a backend gets. Here the number of turns of
  backend i is exactly its weight share of M (largest-remainder rounding), so
  the share of every backend is exact to within one slot; turns are
  interleaved smoothly (backend i's k-th turn at virtual time (k + 1/2) / w_i);
- only active backends are in the table (terminating, quarantined and
  maintenance backends get no new flows); no active backend gives a table of
  zeros (0 is no backend id);
- removing or adding one of N backends moves close to 1/N of the slots.

Cost: the fill does about M ln M probes in the worst case, each a few
bytecodes; M=16,381 with 100 backends takes ~6-8 ms on the development
machine (see docs/lb.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Cilium's supported table sizes (primes, each a little under a power of 2).
SUPPORTED_SIZES = (251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071)
DEFAULT_SIZE = 16381
# A base64 string of 12 bytes, as Cilium's --bpf-lb-maglev-hash-seed (this is
# Cilium's default value, so that operators recognise it).
DEFAULT_SEED = "JLfvgnHc2kaSUFaI"
SEED_BYTES = 12
# Backend indices are packed into the low bits of the turn-ordering keys.
_INDEX_BITS = 20
_INDEX_MASK = (1 << _INDEX_BITS) - 1
_TIME_SCALE = 1 << 48


def parse_seed(value: str) -> bytes:
    """The 12 seed bytes of a base64 seed string. Raises ValueError."""
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{value!r} is not base64") from None
    if len(raw) != SEED_BYTES:
        raise ValueError(f"{value!r} decodes to {len(raw)} bytes, not {SEED_BYTES}")
    return raw


def check_size(m: int) -> int:
    if m not in SUPPORTED_SIZES:
        raise ValueError(f"{m} is not a supported Maglev table size ({supported_sizes_text()})")
    return m


def supported_sizes_text() -> str:
    return ", ".join(str(s) for s in SUPPORTED_SIZES)


@dataclass(frozen=True, slots=True)
class MaglevBackend:
    """What the table of a service depends on, per active backend."""

    key: str  # "address:port/protocol", the same on every node
    id: int  # what the table's slots hold
    weight: int = 1


def backend_key(address: str, port: int, protocol: str) -> str:
    """The hash key of a backend; address in canonical form."""
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{port}/{protocol}"


def offset_and_skip(key: str, m: int, seed: bytes) -> tuple[int, int]:
    """Where backend `key`'s permutation starts and its stride, in [0, M) and
    [1, M)."""
    digest = hashlib.blake2b(key.encode(), digest_size=16, key=seed).digest()
    offset = int.from_bytes(digest[:8], "little") % m
    skip = int.from_bytes(digest[8:], "little") % (m - 1) + 1
    return offset, skip


def turn_counts(weights: Sequence[int], m: int) -> list[int]:
    """How many slots each backend gets: its weight share of m, rounded by
    largest remainder (ties to the lower index); the counts add up to m."""
    total = sum(weights)
    counts = [m * w // total for w in weights]
    missing = m - sum(counts)
    if missing:
        by_remainder = sorted(range(len(weights)), key=lambda i: (-(m * weights[i] % total), i))
        for i in by_remainder[:missing]:
            counts[i] += 1
    return counts


def turn_order(weights: Sequence[int], m: int) -> list[int]:
    """The backend index of each of the m turns. Equal weights: round robin.
    Otherwise each backend's turns are spread evenly over the sequence: the
    k-th turn of backend i at virtual time (2k+1)/(2 w_i), ties by index
    (integer arithmetic, so every machine orders them alike)."""
    n = len(weights)
    if n == 0:
        return []
    if all(w == weights[0] for w in weights):
        order = list(range(n)) * (m // n)
        order.extend(range(m % n))
        return order
    counts = turn_counts(weights, m)
    keys: list[int] = []
    for i, (w, c) in enumerate(zip(weights, counts, strict=True)):
        keys.extend([(((2 * k + 1) * _TIME_SCALE // w) << _INDEX_BITS) | i for k in range(c)])
    keys.sort()
    return [k & _INDEX_MASK for k in keys]


def lookup_table(backends: Iterable[MaglevBackend], m: int, seed: bytes) -> list[int]:
    """The M slots of the table: each the id of a backend."""
    ordered = sorted(backends, key=lambda b: b.key)
    if not ordered:
        return [0] * m
    if len(ordered) > _INDEX_MASK:
        raise ValueError("too many backends")
    for b in ordered:
        if b.weight <= 0:
            raise ValueError(f"backend {b.key} has weight {b.weight}")
    params = [offset_and_skip(b.key, m, seed) for b in ordered]
    position = [p[0] for p in params]
    skips = [p[1] for p in params]
    owner: list[int | None] = [None] * m
    # The hot loop: ~M ln M probes at worst. Locals only.
    for i in turn_order([b.weight for b in ordered], m):
        c = position[i]
        s = skips[i]
        while owner[c] is not None:
            c += s
            if c >= m:
                c -= m
        owner[c] = i
        c += s
        if c >= m:
            c -= m
        position[i] = c
    ids = [b.id for b in ordered]
    return [ids[i] for i in owner]  # type: ignore[index]  # every slot is filled


def slot_counts(table: Sequence[int]) -> dict[int, int]:
    """Slots per backend id."""
    counts: dict[int, int] = {}
    for bid in table:
        counts[bid] = counts.get(bid, 0) + 1
    return counts
