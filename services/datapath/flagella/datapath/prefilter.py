"""The XDP prefilter of this node (Cilium's GetPrefilter / PatchPrefilter /
DeletePrefilter): a list of source CIDRs dropped on the node's devices
before the stack, with a revision that every change must name.

The list is kept in the state folder (prefilter.json, written atomically
before the maps change): a restarted datapath writes it into the pinned
maps and re-attaches the program before it serves. The pinned per-CPU
counters survive a restart too; a CIDR keeps its counter slot as long as it
is listed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flagella.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from flagella.datapath.bpf.prefilter import MAX_ENTRIES, IPNetwork

log = logging.getLogger(__name__)
#: Runs a map operation on the datapath's map thread.
Run = Callable[..., Awaitable[Any]]


class PrefilterTable(Protocol):
    """The prefilter's maps (flagella.datapath.bpf.prefilter.PrefilterMaps)."""

    def entries(self) -> dict[IPNetwork, int]: ...

    def put(self, net: IPNetwork, slot: int, *, reset: bool) -> None: ...

    def remove(self, net: IPNetwork) -> None: ...

    def counts(self, slots: list[int]) -> dict[int, tuple[int, int]]: ...


@dataclass(frozen=True)
class PrefilterEntry:
    cidr: IPNetwork
    packets: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class PrefilterDevice:
    name: str
    ifindex: int
    mode: str  # native or generic, as attached at start
    attached: bool = True  # runs this datapath's program (checked at each read)


@dataclass(frozen=True)
class PrefilterState:
    revision: int
    entries: tuple[PrefilterEntry, ...]
    devices: tuple[PrefilterDevice, ...]
    max_entries: int = MAX_ENTRIES


def parse_cidrs(texts: Sequence[str], field: str = "cidrs") -> list[IPNetwork]:
    """Each text a CIDR with no host bits; the error names field[i]."""
    out: list[IPNetwork] = []
    for i, text in enumerate(texts):
        where = f"{field}[{i}]"
        try:
            loose = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise InvalidArgument(f"{text!r} is not a CIDR", field=where) from None
        if "/" not in text:
            raise InvalidArgument(f"{text!r} has no prefix length (e.g. {loose})", field=where)
        try:
            ipaddress.ip_network(text, strict=True)
        except ValueError:
            raise InvalidArgument(
                f"{text!r} has host bits set (the network is {loose})", field=where
            ) from None
        out.append(loose)
    return out


class Prefilter:
    """The list, its file, its maps and its devices."""

    def __init__(self, state_dir: str, run: Run) -> None:
        self.path = Path(state_dir) / "prefilter.json"
        self.run = run
        self.revision = 0
        self.slots: dict[IPNetwork, int] = {}
        self.devices: list[PrefilterDevice] = []
        self.maps: PrefilterTable | None = None
        self._attached: Callable[[int], object | None] = lambda _: None
        self._lock = asyncio.Lock()

    # --- start ---

    def _load(self) -> list[str]:
        """The saved list; returns the devices it was attached to."""
        try:
            doc = json.loads(self.path.read_text())
            self.revision = int(doc["revision"])
            self.slots = {ipaddress.ip_network(c): int(s) for c, s in doc["cidrs"].items()}
            if len(set(self.slots.values())) != len(self.slots) or not all(
                0 <= s < MAX_ENTRIES for s in self.slots.values()
            ):
                raise ValueError("counter slots are not distinct or out of range")
            return [str(d) for d in doc.get("devices", [])]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # Not a list we wrote: better an error at start than a guess.
            raise FailedPrecondition(
                f"{self.path} is unreadable ({exc}); remove it to start with an empty prefilter",
                field="state_dir",
            ) from None

    async def start(
        self,
        maps: PrefilterTable,
        attach: Callable[[int], str],
        attached: Callable[[int], object | None],
        devices: dict[str, int],
        detach: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        """The saved list into the maps, then the program on each device
        (before SERVING). attached(ifindex): the device runs our program;
        detach(name): take it off a device the last run used and this one
        does not (its program would go on dropping)."""
        self.maps = maps
        self._attached = attached
        before = self._load()
        await self.run(self._sync_maps, {})
        for name in before:
            if name not in devices and detach is not None:
                await detach(name)
        for name, ifindex in devices.items():
            try:
                mode = await self.run(attach, ifindex)
                self.devices.append(PrefilterDevice(name, ifindex, mode))
            except OSError as exc:
                # A device that refuses XDP is reported, and fails the start.
                raise FailedPrecondition(
                    f"cannot attach the XDP prefilter to {name}: {exc}", field="prefilter_devices"
                ) from None
        if before != list(devices):
            await asyncio.to_thread(self._save, self.revision, self.slots)
        log.info(
            "XDP prefilter ready",
            extra={
                "revision": self.revision,
                "cidrs": len(self.slots),
                "devices": {d.name: d.mode for d in self.devices},
            },
        )

    def _sync_maps(self, before: dict[IPNetwork, int]) -> None:
        """Make the maps hold self.slots: new or moved entries (their
        counters zeroed when the slot changed hands), then stale ones."""
        assert self.maps is not None
        actual = self.maps.entries()
        for net, slot in self.slots.items():
            if actual.get(net) != slot:
                self.maps.put(net, slot, reset=before.get(net) != slot)
        for net in actual:
            if net not in self.slots:
                self.maps.remove(net)

    # --- the API ---

    async def get(self) -> PrefilterState:
        assert self.maps is not None
        order = sorted(self.slots, key=lambda n: (n.version, n))
        counts = await self.run(self.maps.counts, [self.slots[n] for n in order])
        entries = tuple(PrefilterEntry(n, *counts[self.slots[n]]) for n in order)
        devices = []
        for d in self.devices:
            running = await self.run(self._attached, d.ifindex) is not None
            devices.append(dataclasses.replace(d, attached=running))
        return PrefilterState(self.revision, entries, tuple(devices))

    def totals(self) -> dict[str, tuple[int, int, int]]:
        """family -> (CIDRs, packets, bytes) dropped over all its CIDRs
        (the metrics' scrape: one lookup per listed CIDR)."""
        slots = dict(self.slots)  # replaced whole by a change: a stable view
        out = {"ipv4": (0, 0, 0), "ipv6": (0, 0, 0)}
        if self.maps is None:
            return out
        counts = self.maps.counts(list(slots.values()))
        for net, slot in slots.items():
            family = f"ipv{net.version}"
            n, p, b = out[family]
            out[family] = (n + 1, p + counts[slot][0], b + counts[slot][1])
        return out

    async def patch(self, cidrs: Sequence[IPNetwork], revision: int) -> PrefilterState:
        """Adds cidrs (already listed ones stay as they are)."""
        async with self._lock:
            self._check_revision(revision)
            new: list[IPNetwork] = []
            for i, c in enumerate(cidrs):
                if c in self.slots or c in new:
                    continue
                if len(self.slots) + len(new) >= MAX_ENTRIES:
                    raise InvalidArgument(
                        f"the prefilter holds at most {MAX_ENTRIES} CIDRs "
                        f"({len(self.slots)} listed)",
                        field=f"cidrs[{i}]",
                    )
                new.append(c)
            if new:
                taken = set(self.slots.values())
                free = (s for s in range(MAX_ENTRIES) if s not in taken)
                after = dict(self.slots)
                for c in new:
                    after[c] = next(free)
                await self._commit(after)
        return await self.get()

    async def delete(self, cidrs: Sequence[IPNetwork], revision: int) -> PrefilterState:
        async with self._lock:
            self._check_revision(revision)
            for i, c in enumerate(cidrs):
                if c not in self.slots:
                    raise NotFound(f"{c} is not in the prefilter", field=f"cidrs[{i}]")
            after = {n: s for n, s in self.slots.items() if n not in set(cidrs)}
            if after != self.slots:
                await self._commit(after)
        return await self.get()

    def _check_revision(self, revision: int) -> None:
        if revision != self.revision:
            raise FailedPrecondition(
                f"the prefilter is at revision {self.revision}, not {revision}: read it again",
                field="revision",
            )

    async def _commit(self, after: dict[IPNetwork, int]) -> None:
        """The file first (a crash after it: the restart writes the maps),
        then the maps."""
        before = self.slots
        await asyncio.to_thread(self._save, self.revision + 1, after)
        self.revision += 1
        self.slots = after
        try:
            await self.run(self._sync_maps, before)
        except OSError as exc:
            log.error("prefilter maps not written", extra={"reason": str(exc)})
            raise Unavailable(
                f"the list is saved at revision {self.revision} but its maps could not be "
                f"written ({exc}); the next start writes them",
                field="cidrs",
            ) from None

    def _save(self, revision: int, slots: dict[IPNetwork, int]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "revision": revision,
            "cidrs": {str(n): s for n, s in slots.items()},
            "devices": [d.name for d in self.devices],
        }
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".prefilter-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
