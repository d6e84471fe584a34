"""Typed access to one pinned map: get/update/delete/items, batches, counts,
and what this process did to it (MapStats: operations by outcome, entries;
its EventRing: the last writes, for GetMapEvents). Every write the datapath
makes to a pinned map goes through update, delete or update_batch here."""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from flagella.datapath.bpf import syscall
from flagella.datapath.bpf.layout import Fields, MapSpec
from flagella.datapath.bpf.mapevents import DELETE, UPDATE, EventRing

K = TypeVar("K", bound=ctypes.Structure)
V = TypeVar("V", bound=ctypes.Structure)

_BATCH = 4096
_BATCH_TYPES = {syscall.MAP_TYPE_HASH, syscall.MAP_TYPE_LRU_HASH, syscall.MAP_TYPE_ARRAY}
# Batch updates (not lookups) also reach LPM tries through the kernel's
# generic batch code where it has it (6.x here); a kernel refusing falls
# back to one update each (BpfMap.update_batch).
_UPDATE_BATCH_TYPES = _BATCH_TYPES | {syscall.MAP_TYPE_LPM_TRIE}
# What a kernel without a map type's batch operation answers.
_NO_BATCH = {errno.EINVAL, errno.EOPNOTSUPP, 524}  # 524: the kernel's ENOTSUPP


class MapFullError(OSError):
    """The map has no room for another entry (E2BIG / ENOSPC / ENOMEM)."""


class MapStats:
    """Kept by the writers, read at each scrape (no map walk): updates and
    deletes by outcome, as Cilium's cilium_bpf_map_ops_total, and the
    entries of the map when known (Cilium's map pressure): exactly for the
    maps only this process writes (their keys are tracked), as of the last
    GC pass for those the BPF programs fill (conntrack, NAT, ...)."""

    __slots__ = ("entries", "keys", "ops")

    def __init__(self) -> None:
        self.ops: dict[tuple[str, str], int] = {}
        self.entries: int | None = None
        # The keys present, for a map only userspace writes (track()).
        self.keys: set[bytes] | None = None

    def count(self, operation: str, ok: bool, n: int = 1) -> None:
        label = (operation, "success" if ok else "fail")
        self.ops[label] = self.ops.get(label, 0) + n

    def added(self, keys: Iterable[bytes]) -> None:
        if self.keys is not None:
            self.keys.update(keys)
            self.entries = len(self.keys)

    def removed(self, key: bytes, present: bool) -> None:
        if self.keys is not None:
            self.keys.discard(key)
            self.entries = len(self.keys)
        elif present and self.entries:
            self.entries -= 1  # a map the programs fill: one fewer till the next count


class BpfMap(Generic[K, V]):
    """One map, keys and values as the ctypes classes of its spec."""

    def __init__(self, spec: MapSpec, fd: int, pin_path: str) -> None:
        if spec.key is None or spec.value is None:
            raise TypeError(f"map {spec.name} has no key/value layout")
        self.spec = spec
        self.fd = fd
        self.pin_path = pin_path
        self.key_type: type[K] = spec.key  # type: ignore[assignment]
        self.value_type: type[V] = spec.value  # type: ignore[assignment]
        self.stats = MapStats()
        # Its writes, when the history is on (Datapath gives the ring).
        self.events: EventRing | None = None
        self._batch_updates = spec.map_type in _UPDATE_BATCH_TYPES

    def track(self) -> None:
        """Keep the set of keys from now on (one walk here; then the
        writes keep it): for maps no BPF program writes."""
        self.stats.keys = {bytes(k) for k in self.keys()}
        self.stats.entries = len(self.stats.keys)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def max_entries(self) -> int:
        return self.spec.max_entries

    def get(self, key: K) -> V | None:
        value = self.value_type()
        return value if syscall.map_lookup(self.fd, key, value) else None

    def update(self, key: K, value: V, flags: int = syscall.ANY) -> None:
        raw = bytes(key)
        try:
            syscall.map_update(self.fd, key, value, flags)
        except syscall.BpfError as e:
            self.stats.count("update", False)
            if self.events is not None:
                self.events.one(UPDATE, raw, bytes(value), ok=False, err=e.errno or 0)
            if e.errno in (errno.E2BIG, errno.ENOSPC, errno.ENOMEM):
                raise MapFullError(e.errno, f"map {self.name} is full ({self.max_entries})") from e
            raise
        self.stats.count("update", True)
        self.stats.added((raw,))
        if self.events is not None:
            self.events.one(UPDATE, raw, bytes(value))

    def delete(self, key: K) -> bool:
        """False when the key was absent (not an error)."""
        raw = bytes(key)
        try:
            present = syscall.map_delete(self.fd, key)
        except syscall.BpfError as e:
            self.stats.count("delete", False)
            if self.events is not None:
                self.events.one(DELETE, raw, ok=False, err=e.errno or 0)
            raise
        self.stats.count("delete", True)
        self.stats.removed(raw, present)
        if self.events is not None:
            self.events.one(DELETE, raw, err=0 if present else errno.ENOENT)
        return present

    def update_batch(self, pairs: Sequence[tuple[K, V]]) -> int:
        """Writes every pair, in order; one syscall per 4096 where the map
        type has batch updates (hash, LRU, array, LPM trie), else one per
        entry."""
        return self.update_batch_raw([bytes(k) for k, _ in pairs], [bytes(v) for _, v in pairs])

    def update_batch_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
        """update_batch() of keys and values as their bytes (the layout of
        key_type and value_type): for callers that pack many entries
        without a ctypes object each."""
        if not keys:
            return 0
        if not self._batch_updates:
            for k, v in zip(keys, values, strict=True):
                self.update(self.key_type.from_buffer_copy(k), self.value_type.from_buffer_copy(v))
            return len(keys)
        done = 0
        for start in range(0, len(keys), _BATCH):
            key_bytes = keys[start : start + _BATCH]
            value_bytes = values[start : start + _BATCH]
            count = len(key_bytes)
            ks = (self.key_type * count).from_buffer_copy(b"".join(key_bytes))
            vs = (self.value_type * count).from_buffer_copy(b"".join(value_bytes))
            try:
                n = syscall.map_update_batch(self.fd, ks, vs, count)
            except syscall.BpfError as e:
                if e.errno in _NO_BATCH and self.spec.map_type not in _BATCH_TYPES:
                    self._batch_updates = False  # this kernel's LPM trie has none
                    return done + self.update_batch_raw(keys[start:], values[start:])
                self.stats.count("update", False, count)
                if self.events is not None:  # which of the batch got in is unknown
                    self.events.record(UPDATE, key_bytes, value_bytes, ok=False, err=e.errno or 0)
                if self.stats.keys is not None:
                    self.track()  # part of the batch may be in: read what is
                if e.errno in (errno.E2BIG, errno.ENOSPC, errno.ENOMEM):
                    raise MapFullError(e.errno, f"map {self.name} is full") from e
                raise
            done += n
            self.stats.count("update", True, n)
            self.stats.added(key_bytes[:n])
            if self.events is not None:
                self.events.record(UPDATE, key_bytes[:n], value_bytes[:n])
            # A batch cut short: the rest, each raising its error.
            for k, v in zip(key_bytes[n:], value_bytes[n:], strict=True):
                self.update(self.key_type.from_buffer_copy(k), self.value_type.from_buffer_copy(v))
                done += 1
        return done

    def delete_many(self, keys: Iterable[K]) -> int:
        """Deletes the keys present; returns how many were."""
        n = 0
        for k in keys:
            if self.delete(k):
                n += 1
        return n

    def keys(self) -> Iterator[K]:
        """A snapshot walk (entries changed meanwhile may be missed or seen)."""
        prev: K | None = None
        while True:
            nxt = self.key_type()
            if not syscall.map_next_key(self.fd, prev, nxt):
                return
            yield nxt
            prev = nxt

    def items(self) -> Iterator[tuple[K, V]]:
        if self.spec.map_type in _BATCH_TYPES:
            yield from self._items_batch()
            return
        for k in self.keys():
            v = self.get(k)
            if v is not None:
                yield k, v

    def _items_batch(self) -> Iterator[tuple[K, V]]:
        token_in = (ctypes.c_uint8 * 64)()
        token_out = (ctypes.c_uint8 * 64)()
        first = True
        while True:
            keys = (self.key_type * _BATCH)()
            values = (self.value_type * _BATCH)()
            try:
                n, more = syscall.map_lookup_batch(
                    self.fd, None if first else token_in, token_out, keys, values, count=_BATCH
                )
            except syscall.BpfError as e:
                if e.errno == errno.ENOSPC:  # a bucket larger than the batch
                    yield from self._items_walk()
                    return
                raise
            for i in range(n):
                yield keys[i], values[i]
            if not more:
                return
            ctypes.memmove(token_in, token_out, 64)
            first = False

    def _items_walk(self) -> Iterator[tuple[K, V]]:
        for k in self.keys():
            v = self.get(k)
            if v is not None:
                yield k, v

    def count(self) -> int:
        """Entries in the map (arrays: all of them). Hash maps are counted
        by batch lookups without decoding what they read."""
        if self.spec.map_type in (syscall.MAP_TYPE_ARRAY, syscall.MAP_TYPE_PERCPU_ARRAY):
            return self.max_entries
        if self.spec.map_type not in _BATCH_TYPES:
            return sum(1 for _ in self.keys())
        token_in = (ctypes.c_uint8 * 64)()
        token_out = (ctypes.c_uint8 * 64)()
        keys = (self.key_type * _BATCH)()
        values = (self.value_type * _BATCH)()
        total = 0
        first = True
        while True:
            try:
                n, more = syscall.map_lookup_batch(
                    self.fd, None if first else token_in, token_out, keys, values, count=_BATCH
                )
            except syscall.BpfError as e:
                if e.errno == errno.ENOSPC:  # a bucket larger than the batch
                    return sum(1 for _ in self.keys())
                raise
            total += n
            if not more:
                return total
            ctypes.memmove(token_in, token_out, 64)
            first = False

    def clear(self) -> int:
        return self.delete_many(list(self.keys()))

    def decode(self, key: K, value: V) -> tuple[Fields, Fields]:
        assert self.spec.decode_key is not None
        assert self.spec.decode_value is not None
        return self.spec.decode_key(key), self.spec.decode_value(value)

    def decode_raw(self, key: bytes, value: bytes) -> tuple[Fields, Fields]:
        """A key and value as bytes (a map event's), decoded; no value: {}."""
        assert self.spec.decode_key is not None
        assert self.spec.decode_value is not None
        fields = self.spec.decode_key(self.key_type.from_buffer_copy(key))
        if not value:
            return fields, {}
        return fields, self.spec.decode_value(self.value_type.from_buffer_copy(value))

    def dump(self, limit: int = 0) -> list[tuple[Fields, Fields]]:
        """Entries decoded to named fields (DumpMap); limit 0: all."""
        out = []
        for k, v in self.items():
            out.append(self.decode(k, v))
            if limit and len(out) >= limit:
                break
        return out


class PerCpuArray(BpfMap[K, V]):
    """A per-CPU array: a lookup returns one value per possible CPU."""

    def get_percpu(self, key: K) -> list[V]:
        ncpu = syscall.possible_cpus()
        values = (self.value_type * ncpu)()
        if not syscall.map_lookup(self.fd, key, values):
            return []
        return list(values)

    def get(self, key: K) -> V | None:
        """The sum over CPUs of every integer field."""
        per = self.get_percpu(key)
        if not per:
            return None
        total = self.value_type()
        for f in total._fields_:
            fname = f[0]
            setattr(total, fname, sum(getattr(v, fname) for v in per))
        return total

    def update(self, key: K, value: V, flags: int = syscall.ANY) -> None:
        """Sets the value on CPU 0 and zero on the others."""
        ncpu = syscall.possible_cpus()
        values = (self.value_type * ncpu)()
        values[0] = value
        try:
            syscall.map_update(self.fd, key, values, flags)
        except syscall.BpfError as e:
            if self.events is not None:
                self.events.one(UPDATE, bytes(key), bytes(value), ok=False, err=e.errno or 0)
            raise
        if self.events is not None:
            self.events.one(UPDATE, bytes(key), bytes(value))

    def items(self) -> Iterator[tuple[K, V]]:
        """Every slot, summed over CPUs: one batch lookup (a scrape reads
        the whole metrics map), else a lookup per slot."""
        try:
            yield from self._items_batch_percpu()
            return
        except syscall.BpfError:
            pass  # no batch operations on this kernel
        for i in range(self.max_entries):
            k = self.key_type()
            ctypes.memmove(ctypes.addressof(k), ctypes.byref(ctypes.c_uint32(i)), 4)
            v = self.get(k)
            if v is not None:
                yield k, v

    def _items_batch_percpu(self) -> list[tuple[K, V]]:
        ncpu = syscall.possible_cpus()
        n = self.max_entries
        keys = (self.key_type * n)()
        # The kernel writes each value once per possible CPU (values here
        # are multiples of 8 bytes, the per-CPU stride).
        values = (self.value_type * (n * ncpu))()
        token = (ctypes.c_uint8 * 64)()
        got, _ = syscall.map_lookup_batch(self.fd, None, token, keys, values, count=n)
        out = []
        names = [f[0] for f in self.value_type._fields_]
        for i in range(got):
            total = self.value_type()
            per = values[i * ncpu : (i + 1) * ncpu]
            for fname in names:
                setattr(total, fname, sum(getattr(v, fname) for v in per))
            out.append((keys[i], total))
        return out
