"""Service load balancing maps: services (frontends and backend slots),
backends, rev-NAT, Maglev tables, session affinity, source ranges."""

from __future__ import annotations

import array
import collections
import ctypes
import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import syscall
from flagella.datapath.bpf.maps import BpfMap

BACKEND_ACTIVE = L.BACKEND_ACTIVE
AFFINITY_DEFAULT_TIMEOUT = 10800  # seconds, as Kubernetes
MAX_REV_NAT_ID = (1 << 24) - 1


def frontend_rev_nat_id(rev_nat_id: int, frontend_index: int) -> int:
    """A rev-NAT id per frontend of one service: the lb service's rev_nat_id
    for the first frontend (ClusterIP), then index << 24 | rev_nat_id for
    the others (NodePort addresses). Needs rev_nat_id < 2**24."""
    if not 0 < rev_nat_id <= MAX_REV_NAT_ID or not 0 <= frontend_index < 256:
        raise ValueError(f"rev_nat_id {rev_nat_id} / frontend {frontend_index} out of range")
    return (frontend_index << 24) | rev_nat_id


@dataclass(frozen=True)
class Frontend:
    address: str
    port: int
    protocol: int  # 6 or 17
    rev_nat_id: int  # reverse NAT of replies to this frontend
    nodeport: bool = False
    # externalTrafficPolicy Local: traffic from outside the node reaches
    # this node's own active backends only (none: dropped).
    local_only: bool = False


@dataclass(frozen=True)
class Backend:
    id: int
    address: str
    port: int
    protocol: int = L.PROTO_TCP
    state: int = BACKEND_ACTIVE  # only active backends get new connections
    local: bool = False  # on this node (what externalTrafficPolicy Local uses)


@dataclass(frozen=True)
class Service:
    """What the datapath needs of one lb.v1.Service."""

    service_id: int
    frontends: tuple[Frontend, ...]
    backends: tuple[Backend, ...]
    maglev: bool = False
    maglev_table: tuple[int, ...] = ()  # backend id per slot (lb.v1.MaglevTable)
    affinity_timeout: int = 0  # seconds of ClientIP affinity; 0: none
    source_ranges: tuple[str, ...] = ()  # loadBalancerSourceRanges; empty: all
    name: str = ""  # the lb service's name (what local redirect policies match)
    # healthCheckNodePort (not in the maps: the node answers it, healthcheck.py).
    health_check_port: int = 0


def svc_key(
    address: str, port: int, protocol: int, slot: int = 0, scope: int = L.SVC_SCOPE_ALL
) -> L.SvcKey:
    k = L.SvcKey(dport=L.port_be(port), slot=slot, proto=protocol, scope=scope)
    L.set_addr(k.addr, address)
    return k


FrontendKey = tuple[str, int, int]  # (address, port, protocol)


@dataclass(frozen=True)
class FrontendWrite:
    """One frontend of a service to write (Services.write_frontends)."""

    frontend: Frontend
    service_id: int
    backend_ids: Sequence[int]
    flags: int
    affinity_timeout: int
    maglev_size: int
    # The frontend's entry for outside traffic under externalTrafficPolicy
    # Local (scope SVC_SCOPE_LOCAL): this node's active backends; None: it
    # has none.
    local_backend_ids: Sequence[int] | None = None


def _write_all(m: BpfMap[Any, Any], pairs: Sequence[tuple[Any, Any]]) -> None:
    written = m.update_batch(pairs)
    if written != len(pairs):
        raise OSError(f"map {m.name}: {written} of {len(pairs)} entries written")


class Services(BpfMap[L.SvcKey, L.SvcValue]):
    """cilium_lb4_services_v2: slot 0 of a frontend is the service entry,
    slots 1..count the active backends (random selection).

    Which frontends a service has is kept in an index (service id ->
    frontends), built from the map by one walk at first use and then kept
    by write_frontends/remove_frontend, this process being the map's only
    writer: finding a service's frontends by walking the map on every
    upsert made programming n services O(n^2)."""

    _frontends: dict[int, set[FrontendKey]] | None = None

    def _index(self) -> dict[int, set[FrontendKey]]:
        if self._frontends is None:
            index: dict[int, set[FrontendKey]] = {}
            for k, v in self.items():
                if k.slot == 0 and k.scope == L.SVC_SCOPE_ALL:
                    fe = (L.get_addr(k.addr), L.port_host(k.dport), k.proto)
                    index.setdefault(v.service_id, set()).add(fe)
            self._frontends = index
        return self._frontends

    def _indexed(self, fe: FrontendKey, service_id: int, old: L.SvcValue | None) -> None:
        index = self._index()
        if old is not None and old.service_id != service_id:
            self._unindexed(fe, old.service_id)
        index.setdefault(service_id, set()).add(fe)

    def _unindexed(self, fe: FrontendKey, service_id: int) -> None:
        index = self._index()
        owned = index.get(service_id)
        if owned is not None:
            owned.discard(fe)
            if not owned:
                del index[service_id]

    def reindex(self) -> None:
        """Rebuild the index from the map at next use."""
        self._frontends = None

    def clear(self) -> int:
        self._frontends = None
        return super().clear()

    def frontend(self, address: str, port: int, protocol: int) -> L.SvcValue | None:
        return self.get(svc_key(address, port, protocol))

    def write_frontends(self, items: Sequence[FrontendWrite]) -> None:
        """Writes frontends (distinct) in an order that keeps every service
        consistent for packets: all backend slots (batch syscalls), then all
        service entries, then slots beyond a frontend's new count go. Raises
        on a failed write (map full): what was written is left for the
        caller to rewrite."""
        olds: list[L.SvcValue | None] = []
        old_locals: list[L.SvcValue | None] = []
        slots: list[tuple[L.SvcKey, L.SvcValue]] = []
        local_masters: list[tuple[L.SvcKey, L.SvcValue]] = []
        masters: list[tuple[L.SvcKey, L.SvcValue]] = []
        for w in items:
            fe = w.frontend
            key = svc_key(fe.address, fe.port, fe.protocol)
            old = self.get(key)
            olds.append(old)
            # A node-port frontend's local entry is read even without the
            # flag: one written just before a crash (the flag never came)
            # goes at the next write.
            had_local = old is not None and old.flags & L.SVC_F_EXT_LOCAL
            old_locals.append(
                self._local_master(fe.address, fe.port, fe.protocol)
                if had_local or fe.nodeport or w.local_backend_ids is not None
                else None
            )
            slots += [
                (
                    svc_key(fe.address, fe.port, fe.protocol, i + 1),
                    L.SvcValue(backend_id=bid, rev_nat_id=fe.rev_nat_id, service_id=w.service_id),
                )
                for i, bid in enumerate(w.backend_ids)
            ]
            flags = w.flags | (L.SVC_F_NODEPORT if fe.nodeport else 0)
            if w.local_backend_ids is not None:
                local = L.SVC_SCOPE_LOCAL
                slots += [
                    (
                        svc_key(fe.address, fe.port, fe.protocol, i + 1, local),
                        L.SvcValue(
                            backend_id=bid, rev_nat_id=fe.rev_nat_id, service_id=w.service_id
                        ),
                    )
                    for i, bid in enumerate(w.local_backend_ids)
                ]
                # Random selection over the local backends: the Maglev
                # table is the service's, over all of them.
                local_master = L.SvcValue(
                    count=len(w.local_backend_ids),
                    rev_nat_id=fe.rev_nat_id,
                    service_id=w.service_id,
                    flags=flags & ~L.SVC_F_MAGLEV,
                    affinity_timeout=w.affinity_timeout,
                )
                local_masters.append(
                    (svc_key(fe.address, fe.port, fe.protocol, 0, local), local_master)
                )
                flags |= L.SVC_F_EXT_LOCAL
            master = L.SvcValue(
                count=len(w.backend_ids),
                rev_nat_id=fe.rev_nat_id,
                service_id=w.service_id,
                flags=flags,
                affinity_timeout=w.affinity_timeout,
                maglev_size=w.maglev_size,
            )
            masters.append((key, master))
        # Slots, then the local entries, then the entries that point at
        # them: a packet never finds a count beyond the slots written.
        _write_all(self, slots)
        _write_all(self, local_masters)
        _write_all(self, masters)
        stale = []
        for w, old, old_local in zip(items, olds, old_locals, strict=True):
            fe = w.frontend
            self._indexed(
                (L.bytes_ip(L.ip_bytes(fe.address)), fe.port, fe.protocol), w.service_id, old
            )
            old_count = old.count if old is not None else 0
            stale += [
                svc_key(fe.address, fe.port, fe.protocol, i)
                for i in range(len(w.backend_ids) + 1, old_count + 1)
            ]
            if old_local is not None:
                keep = len(w.local_backend_ids) if w.local_backend_ids is not None else -1
                stale += [
                    svc_key(fe.address, fe.port, fe.protocol, i, L.SVC_SCOPE_LOCAL)
                    for i in range(keep + 1, old_local.count + 1)
                ]
        self.delete_many(stale)

    def _local_master(self, address: str, port: int, protocol: int) -> L.SvcValue | None:
        return self.get(svc_key(address, port, protocol, 0, L.SVC_SCOPE_LOCAL))

    def remove_frontend(self, address: str, port: int, protocol: int) -> bool:
        old = self.frontend(address, port, protocol)
        if old is None:
            return False
        self.delete(svc_key(address, port, protocol))
        self._unindexed((L.bytes_ip(L.ip_bytes(address)), port, protocol), old.service_id)
        self.delete_many(svc_key(address, port, protocol, i) for i in range(1, old.count + 1))
        local = self._local_master(address, port, protocol)
        if local is not None:
            scope = L.SVC_SCOPE_LOCAL
            self.delete_many(
                svc_key(address, port, protocol, i, scope) for i in range(local.count + 1)
            )
        return True

    def frontends_of(self, service_id: int) -> list[FrontendKey]:
        """(address, port, protocol) of the service's frontends."""
        return sorted(self._index().get(service_id, ()))

    def service_ids(self) -> set[int]:
        """Every service with a frontend in the map."""
        return set(self._index())


class Backends(BpfMap[L.U32, L.BackendValue]):
    """cilium_lb4_backends: backend id -> address, port."""

    def upsert(self, b: Backend) -> None:
        v = L.BackendValue(port=L.port_be(b.port), proto=b.protocol, state=b.state)
        L.set_addr(v.addr, b.address)
        self.update(L.U32(b.id), v)

    def upsert_many(self, backends: Iterable[Backend]) -> None:
        """upsert() of many, in batches (a backend listed twice: the last)."""
        values: dict[int, L.BackendValue] = {}
        for b in backends:
            v = L.BackendValue(port=L.port_be(b.port), proto=b.protocol, state=b.state)
            L.set_addr(v.addr, b.address)
            values[b.id] = v
        _write_all(self, [(L.U32(i), v) for i, v in values.items()])

    def remove(self, backend_id: int) -> bool:
        return self.delete(L.U32(backend_id))

    def lookup(self, backend_id: int) -> tuple[str, int] | None:
        v = self.get(L.U32(backend_id))
        return (L.get_addr(v.addr), L.port_host(v.port)) if v is not None else None


class RevNat(BpfMap[L.U32, L.RevNatValue]):
    """cilium_lb4_reverse_nat: rev-NAT id -> frontend address and port."""

    def upsert(self, rev_nat_id: int, address: str, port: int) -> None:
        v = L.RevNatValue(port=L.port_be(port))
        L.set_addr(v.addr, address)
        self.update(L.U32(rev_nat_id), v)

    def upsert_many(self, entries: Iterable[tuple[int, str, int]]) -> None:
        """upsert() of many (rev-NAT id, address, port), in batches."""
        values: dict[int, L.RevNatValue] = {}
        for rev_nat_id, address, port in entries:
            v = L.RevNatValue(port=L.port_be(port))
            L.set_addr(v.addr, address)
            values[rev_nat_id] = v
        _write_all(self, [(L.U32(i), v) for i, v in values.items()])

    def remove(self, rev_nat_id: int) -> bool:
        return self.delete(L.U32(rev_nat_id))


class Maglev(BpfMap[L.U32, L.U32]):
    """Maglev tables (cilium_lb4_maglev): a hash of maps, service id -> an
    array of 1 + M backend ids, [0] = M, [1 + slot] = the backend of slot.
    Each service's array has its own M and exists only while the service
    has a table; a new table is a new array swapped in by one update.

    Which services have a table is kept in a set (built from the map at
    first use, then kept by set_table/remove_table, this process being the
    map's only writer), so removing the table of a service that has none,
    as every upsert of a non-Maglev service does, costs no syscall."""

    _ids: set[int] | None = None

    def _with_table(self) -> set[int]:
        if self._ids is None:
            self._ids = {k.value for k in self.keys()}
        return self._ids

    def clear(self) -> int:
        self._ids = None
        return super().clear()

    def _inner_spec(self, entries: int) -> L.MapSpec:
        assert self.spec.inner is not None
        return dataclasses.replace(self.spec.inner, max_entries=entries)

    def set_table(self, service_id: int, table: Sequence[int]) -> bool:
        """Writes the service's table: a new array, filled, then put in the
        outer map (the old array goes once no packet uses it). The outer
        write returns only after an RCU grace period (the kernel makes sure
        no program still uses the old table), some milliseconds: a table
        equal to the one in place is not written again (False)."""
        if not table:
            raise ValueError(f"service {service_id}: empty Maglev table")
        values_list = array.array("I", [len(table)])
        values_list.extend(table)
        current = self.get(L.U32(service_id))
        if current is not None and self._read(current.value) == values_list.tolist():
            return False
        n = len(values_list)
        spec = self._inner_spec(n)
        fd = syscall.map_create(
            spec.map_type,
            spec.key_size,
            spec.value_size,
            spec.max_entries,
            flags=spec.flags,
            name=f"maglev_{service_id}",
        )
        try:
            keys = (ctypes.c_uint32 * n).from_buffer(array.array("I", range(n)))
            values = (ctypes.c_uint32 * n).from_buffer(values_list)
            written = syscall.map_update_batch(fd, keys, values, n)
            if written != n:
                raise OSError(f"Maglev table of service {service_id}: {written} of {n} written")
            self.update(L.U32(service_id), L.U32(fd))
        finally:
            os.close(fd)
        self._with_table().add(service_id)
        return True

    def _read(self, map_id: int) -> list[int]:
        """Every entry of an inner array, by its map id (one syscall)."""
        fd = syscall.map_fd_by_id(map_id)
        try:
            n = syscall.map_info(fd).max_entries
            keys = (ctypes.c_uint32 * n)()
            values = (ctypes.c_uint32 * n)()
            out_batch = ctypes.c_uint32()
            got, _ = syscall.map_lookup_batch(fd, None, out_batch, keys, values, count=n)
            return list(values[:got])
        finally:
            os.close(fd)

    def table(self, service_id: int) -> list[int]:
        """The service's table (backend id per slot); [] without one."""
        v = self.get(L.U32(service_id))
        if v is None:
            return []
        values = self._read(v.value)
        return values[1 : 1 + values[L.MAGLEV_SIZE_INDEX]]

    def size(self, service_id: int) -> int:
        """M of the service's table; 0 without one."""
        return len(self.table(service_id))

    def service_ids(self) -> list[int]:
        return sorted(k.value for k in self.keys())

    def remove_table(self, service_id: int) -> bool:
        ids = self._with_table()
        if service_id not in ids:
            return False
        ids.discard(service_id)
        return self.delete(L.U32(service_id))

    def dump(self, limit: int = 0) -> list[tuple[L.Fields, L.Fields]]:
        """One row per service: its inner map, M and slots per backend."""
        out = []
        for k, v in self.items():
            table = self.table(k.value)
            shares = collections.Counter(table)
            out.append(
                (
                    {"service_id": str(k.value)},
                    {
                        "map_id": str(v.value),
                        "size": str(len(table)),
                        "slots": ",".join(f"{b}:{n}" for b, n in sorted(shares.items())) or "-",
                    },
                )
            )
            if limit and len(out) >= limit:
                break
        return out


class Affinity(BpfMap[L.AffinityKey, L.AffinityValue]):
    """cilium_lb4_affinity: (client, service) -> backend, last use."""

    def lookup(self, client: str, service_id: int) -> tuple[int, int] | None:
        """(backend id, last used ns)."""
        k = L.AffinityKey(service_id=service_id)
        L.set_addr(k.client, client)
        v = self.get(k)
        return (v.backend_id, v.last_used) if v is not None else None

    def purge(self, service_ids: Iterable[int] = (), backend_ids: Iterable[int] = ()) -> int:
        sids, bids = set(service_ids), set(backend_ids)
        return self.delete_many(
            [k for k, v in self.items() if k.service_id in sids or v.backend_id in bids]
        )


def srcrange_key(service_id: int, cidr: str) -> L.SrcRangeKey:
    family, raw, bits = L.prefix_bits(cidr)
    k = L.SrcRangeKey(prefixlen=32 + 8 + bits, service_id=service_id, family=family)
    ctypes.memmove(ctypes.addressof(k.addr), raw, 16)
    return k


class SourceRanges(BpfMap[L.SrcRangeKey, L.U32]):
    """cilium_lb4_source_range: (service id, client prefix). The keys of each
    service are indexed (built by one walk at first use, then kept by
    set_ranges) so that writing a service does not walk the whole map."""

    _keys: dict[int, dict[bytes, L.SrcRangeKey]] | None = None

    def _index(self) -> dict[int, dict[bytes, L.SrcRangeKey]]:
        if self._keys is None:
            index: dict[int, dict[bytes, L.SrcRangeKey]] = {}
            for k in list(self.keys()):
                index.setdefault(k.service_id, {})[bytes(k)] = k
            self._keys = index
        return self._keys

    def set_ranges(self, service_id: int, cidrs: Iterable[str]) -> None:
        index = self._index()
        wanted = {bytes(k): k for k in (srcrange_key(service_id, c) for c in cidrs)}
        for k in wanted.values():
            self.update(k, L.U32(1))
        for raw, k in list(index.get(service_id, {}).items()):
            if raw not in wanted:
                self.delete(k)
        if wanted:
            index[service_id] = wanted
        else:
            index.pop(service_id, None)

    def clear(self) -> int:
        self._keys = None
        return super().clear()

    def ranges(self, service_id: int) -> list[str]:
        return [L.decode_srcrange_key(k)["cidr"] for k in self.keys() if k.service_id == service_id]
