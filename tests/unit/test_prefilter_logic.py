"""The prefilter's list logic (flagella.datapath.prefilter) over fake maps,
and ipam's Node annotation parsing and write-back contents (pure logic)."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path
from typing import Any

import pytest

from flagella.common.errors import FailedPrecondition, InvalidArgument, NotFound
from flagella.datapath.bpf.prefilter import MAX_ENTRIES, IPNetwork
from flagella.datapath.prefilter import Prefilter, parse_cidrs
from flagella.ipam.kube import annotation_cidrs, node_annotations


class FakeMaps:
    """The tries and counters as dicts; put(reset) zeroes a counter."""

    def __init__(self) -> None:
        self.tries: dict[IPNetwork, int] = {}
        self.drops: dict[int, tuple[int, int]] = {}

    def entries(self) -> dict[IPNetwork, int]:
        return dict(self.tries)

    def put(self, net: IPNetwork, slot: int, *, reset: bool) -> None:
        if reset:
            self.drops[slot] = (0, 0)
        self.tries[net] = slot

    def remove(self, net: IPNetwork) -> None:
        del self.tries[net]

    def counts(self, slots: list[int]) -> dict[int, tuple[int, int]]:
        return {s: self.drops.get(s, (0, 0)) for s in slots}


async def _run(fn: Any, *args: Any) -> Any:
    return fn(*args)


def net(text: str) -> IPNetwork:
    return ipaddress.ip_network(text)


def test_parse_cidrs_names_the_entry() -> None:
    assert parse_cidrs(["10.0.0.0/8", "2001:db8::/32"]) == [net("10.0.0.0/8"), net("2001:db8::/32")]
    for bad, reason in (
        ("x", "not a CIDR"),
        ("10.0.0.1", "no prefix"),
        ("10.0.0.1/8", "host bits"),
    ):
        with pytest.raises(InvalidArgument) as err:
            parse_cidrs(["10.0.0.0/8", bad])
        assert err.value.field == "cidrs[1]"
        assert reason in err.value.message


def test_revisions_slots_limit_and_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        maps = FakeMaps()
        pf = Prefilter(str(tmp_path), _run)
        await pf.start(maps, lambda i: "native", lambda i: object(), {"up0": 3})
        state = await pf.patch([net("10.0.0.0/8"), net("10.0.0.0/8"), net("fd00::/8")], 0)
        assert state.revision == 1
        assert maps.tries == {net("10.0.0.0/8"): 0, net("fd00::/8"): 1}
        # Listed again: nothing changes, the revision stays.
        assert (await pf.patch([net("10.0.0.0/8")], 1)).revision == 1
        with pytest.raises(FailedPrecondition) as stale:
            await pf.patch([net("192.0.2.0/24")], 0)
        assert stale.value.field == "revision"
        with pytest.raises(NotFound) as missing:
            await pf.delete([net("10.0.0.0/8"), net("192.0.2.0/24")], 1)
        assert missing.value.field == "cidrs[1]"
        maps.drops[0] = (5, 500)
        assert (await pf.get()).entries[0].packets == 5
        # A freed slot is zeroed before a new CIDR takes it.
        await pf.delete([net("10.0.0.0/8")], 1)
        state = await pf.patch([net("192.0.2.0/24")], 2)
        assert maps.tries[net("192.0.2.0/24")] == 0
        assert [e.packets for e in state.entries] == [0, 0]
        # The limit: the first CIDR past it is named.
        many = [net(f"10.{i // 256}.{i % 256}.0/24") for i in range(MAX_ENTRIES)]
        with pytest.raises(InvalidArgument) as full:
            await pf.patch(many, 3)
        assert full.value.field == f"cidrs[{MAX_ENTRIES - 2}]"
        assert pf.revision == 3
        assert pf.totals() == {"ipv4": (1, 0, 0), "ipv6": (1, 0, 0)}
        # A restart: the file's list is written into (stale) maps; the
        # device the last run used and this one does not is detached.
        maps.tries[net("198.51.100.0/24")] = 9
        detached: list[str] = []

        async def detach(name: str) -> None:
            detached.append(name)

        again = Prefilter(str(tmp_path), _run)
        await again.start(maps, lambda i: "generic", lambda i: None, {}, detach)
        assert again.revision == 3
        assert maps.tries == {net("192.0.2.0/24"): 0, net("fd00::/8"): 1}
        assert detached == ["up0"]

    asyncio.run(scenario())


def test_node_annotations_sources_and_write_back() -> None:
    ignored: list[str] = []
    got = annotation_cidrs(
        {
            "io.cilium.network.ipv4-pod-cidr": "10.1.0.1/24",  # host bits: ignored
            "flagella.io/ipv4-pod-cidr": "10.1.0.0/24",
            "io.cilium.network.ipv6-pod-cidr": "10.2.0.0/24",  # wrong family: ignored
        },
        "n1",
        ignored.append,
    )
    assert got == ["10.1.0.0/24"]
    assert ignored == ["io.cilium.network.ipv4-pod-cidr", "io.cilium.network.ipv6-pod-cidr"]
    written = node_annotations(["10.1.0.0/24", "fd00::/120"], ["192.0.2.1"])
    assert written == {
        "io.cilium.network.ipv4-pod-cidr": "10.1.0.0/24",
        "flagella.io/ipv4-pod-cidr": "10.1.0.0/24",
        "io.cilium.network.ipv6-pod-cidr": "fd00::/120",
        "flagella.io/ipv6-pod-cidr": "fd00::/120",
        "io.cilium.network.ipv4-health-ip": "192.0.2.1",
        "flagella.io/ipv4-health-ip": "192.0.2.1",
    }
