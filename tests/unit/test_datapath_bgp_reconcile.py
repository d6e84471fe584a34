"""The speaker's reconcile pass (flagella.datapath.bgp.speaker.reconcile)
against a fake of gobgpd's adapter that keeps what it is told (the pass is
diff logic over what gobgpd holds; the real gobgpd is in
tests/e2e/test_bgp.py): a first pass applies everything, a second changes
nothing, a changed prefix set swaps the export policy and resends to that
peer only, what gobgpd refuses is reported with the rest applied, and
gobgpd gone ends the pass."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import grpc
import pytest

from flagella.api.gobgp.v3 import gobgp_pb2 as g
from flagella.common.sync import Table
from flagella.datapath.bgp.gobgp import ExportPolicy, LocalPath, peer_description
from flagella.datapath.bgp.model import (
    AdvertisedService,
    Neighbor,
    NodeInfo,
    PeeringPolicy,
    PeerSpec,
    Selector,
    VirtualRouter,
    desired,
)
from flagella.datapath.bgp.speaker import Speaker, reconcile

NODE = NodeInfo("n1", (), "192.168.100.1", "fd00:100::1", ("10.200.1.0/24",))
ROUTERS = (
    Neighbor("192.168.100.253", 64512, 179, 9, 3, 5, 1),
    Neighbor("192.168.100.254", 64513, 179, 9, 3, 5, 1),
)


class Refused(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeGobgp:
    """What reconcile calls, kept in dicts; calls counted."""

    def __init__(self) -> None:
        self.glob = g.Global()
        self.policies: dict[str, ExportPolicy] = {}
        self.assigned: list[str] = []
        self.default: int = g.NONE
        self.peers: dict[str, g.Peer] = {}
        self.paths: dict[str, str] = {}
        self.resets: list[str] = []
        self.calls: list[str] = []
        self.refuse_peer = ""
        self.down = False

    def _call(self, name: str) -> None:
        if self.down:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "gobgpd gone")
        self.calls.append(name)

    async def get_global(self) -> g.Global:
        self._call("GetBgp")
        return self.glob

    async def start(self, asn: int, router_id: str, port: int, addresses: Iterable[str]) -> None:
        self._call("StartBgp")
        self.glob = g.Global(
            asn=asn, router_id=router_id, listen_port=port, listen_addresses=list(addresses)
        )
        self.assigned, self.default = [], g.REJECT

    async def stop(self) -> None:
        """Everything goes, as gobgpd's StopBgp (the calls stay counted)."""
        self._call("StopBgp")
        self.glob, self.policies, self.assigned, self.default = g.Global(), {}, [], g.NONE
        self.peers, self.paths = {}, {}

    async def export_policies(self) -> dict[str, ExportPolicy]:
        self._call("ListPolicy")
        return dict(self.policies)

    async def assigned_exports(self) -> tuple[list[str], int]:
        self._call("ListPolicyAssignment")
        return list(self.assigned), self.default

    async def add_export_policy(self, name: str, peer: str, prefixes: Iterable[str]) -> None:
        self._call("AddPolicy")
        self.policies[name] = ExportPolicy(name, peer, frozenset(prefixes))

    async def delete_export_policy(self, name: str) -> None:
        self._call("DeletePolicy")
        del self.policies[name]

    async def set_export_assignment(self, names: Iterable[str]) -> None:
        self._call("SetPolicyAssignment")
        self.assigned, self.default = list(names), g.REJECT

    async def list_peers(self, **_: Any) -> list[g.Peer]:
        self._call("ListPeer")
        return list(self.peers.values())

    async def add_peer(self, spec: PeerSpec, global_asn: int) -> None:
        self._call("AddPeer")
        if spec.address == self.refuse_peer:
            raise Refused(grpc.StatusCode.UNKNOWN, "can't configure that neighbor")
        self.peers[spec.address] = g.Peer(
            conf=g.PeerConf(neighbor_address=spec.address, description=peer_description(spec))
        )

    async def delete_peer(self, address: str) -> None:
        self._call("DeletePeer")
        del self.peers[address]

    async def local_paths(self) -> dict[str, LocalPath]:
        self._call("ListPath")
        return {p: LocalPath(p, hop, g.Path()) for p, hop in self.paths.items()}

    async def add_path(self, prefix: str, next_hop: str) -> None:
        self._call("AddPath")
        self.paths[prefix] = next_hop

    async def delete_path(self, path: LocalPath) -> None:
        self._call("DeletePath")
        del self.paths[path.prefix]

    async def reset_out(self, address: str) -> None:
        self._call("ResetPeer")
        self.resets.append(address)


def want(services: list[AdvertisedService], neighbors: tuple[Neighbor, ...] = ROUTERS) -> Any:
    vr = VirtualRouter(65001, True, Selector(), neighbors)
    got = desired(NODE, [PeeringPolicy("p", None, (vr,))], services, 179)
    assert got is not None
    return got


def svc(address: str) -> AdvertisedService:
    return AdvertisedService("a/s", "a", (), (address,), False, frozenset())


def run(fake: FakeGobgp, w: Any) -> dict[str, str]:
    return asyncio.run(reconcile(fake, w, 179))  # type: ignore[arg-type]


WRITES = {"StartBgp", "StopBgp", "AddPolicy", "DeletePolicy", "SetPolicyAssignment", "AddPeer",
          "DeletePeer", "AddPath", "DeletePath", "ResetPeer"}  # fmt: skip


def test_a_pass_applies_everything_and_a_second_writes_nothing() -> None:
    fake = FakeGobgp()
    w = want([svc("198.51.100.1")])
    assert run(fake, w) == {}
    assert (fake.glob.asn, fake.glob.router_id) == (65001, "192.168.100.1")
    assert set(fake.peers) == {"192.168.100.253", "192.168.100.254"}
    assert fake.paths == {"10.200.1.0/24": "192.168.100.1", "198.51.100.1/32": "192.168.100.1"}
    assert sorted(fake.assigned) == sorted(fake.policies)
    assert fake.default == g.REJECT
    assert {p.peer for p in fake.policies.values()} == set(fake.peers)
    fake.calls.clear()
    assert run(fake, w) == {}
    assert not set(fake.calls) & WRITES, fake.calls


def test_a_changed_prefix_set_swaps_the_policies_and_resends() -> None:
    fake = FakeGobgp()
    run(fake, want([svc("198.51.100.1")]))
    before = set(fake.policies)
    run(fake, want([svc("198.51.100.2")]))
    assert fake.paths == {"10.200.1.0/24": "192.168.100.1", "198.51.100.2/32": "192.168.100.1"}
    assert not before & set(fake.policies)
    assert sorted(fake.resets) == ["192.168.100.253", "192.168.100.254"]
    assert all("198.51.100.2/32" in p.prefixes for p in fake.policies.values())


def test_a_changed_neighbor_is_replaced_and_a_gone_one_deleted() -> None:
    fake = FakeGobgp()
    run(fake, want([]))
    slower = Neighbor("192.168.100.253", 64512, 179, 90, 30, 5, 1)
    run(fake, want([], (slower,)))
    assert set(fake.peers) == {"192.168.100.253"}
    new = want([], (slower,)).peers["192.168.100.253"]
    assert fake.peers["192.168.100.253"].conf.description == peer_description(new)


def test_what_gobgpd_refuses_is_reported_and_the_rest_applied() -> None:
    fake = FakeGobgp()
    fake.refuse_peer = "192.168.100.254"
    refused = run(fake, want([svc("198.51.100.1")]))
    assert refused == {"neighbor 192.168.100.254": "can't configure that neighbor"}
    assert set(fake.peers) == {"192.168.100.253"}
    assert "198.51.100.1/32" in fake.paths


def test_gobgpd_gone_ends_the_pass() -> None:
    fake = FakeGobgp()
    fake.down = True
    with pytest.raises(grpc.aio.AioRpcError):
        run(fake, want([]))


def test_new_settings_start_bgp_again() -> None:
    fake = FakeGobgp()
    run(fake, want([]))
    vr = VirtualRouter(65009, True, Selector(), ROUTERS)
    other = desired(NODE, [PeeringPolicy("p", None, (vr,))], [], 179)
    assert other is not None
    run(fake, other)
    assert "StopBgp" in fake.calls
    assert fake.glob.asn == 65009
    assert set(fake.peers) == {"192.168.100.253", "192.168.100.254"}


class _ExitedGobgpd:
    """A gobgpd that exited while the speaker's pass ran: its pid is known,
    it is not running, and its exit (already past) is never signalled
    again."""

    pid = 4242
    running = False

    async def wait_exited(self) -> None:
        await asyncio.Event().wait()


async def test_the_loop_wakes_for_a_gobgpd_that_exited_during_a_pass() -> None:
    speaker = Speaker(
        _ExitedGobgpd(),  # type: ignore[arg-type]
        NODE,
        Table("bgp-policies"),
        lambda table: None,  # type: ignore[arg-type,return-value]
    )
    # Nothing else changed (dirty is clear): the dead gobgpd alone must
    # wake the loop, which then starts another.
    await asyncio.wait_for(speaker._wait(), 1.0)
