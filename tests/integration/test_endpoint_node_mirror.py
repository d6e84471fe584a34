"""The endpoint service's mirror of ipam's node registry against a real ipam:
lookups are answered from it once its WatchNodes stream is synced; a node
that re-registers with another datapath address, or goes away, is seen
through the stream; when ipam goes away the mirror stops answering (lookups
go to ipam and fail as before) until a fresh snapshot is synced."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from ipam_support import Ipam, ipam_args

from flagella.common.errors import NotFound, Unavailable
from flagella.common.tasks import TaskGroup
from flagella.endpoint.peers import IpamPeer

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]


async def until(check: Callable[[], bool], timeout: float = 15) -> None:
    """Poll check (the mirror has no change notification to wait on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_node_mirror_follows_the_registry(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    args = ipam_args(etcd, "--cluster-cidr", "10.40.0.0/16")
    ipam = spawn("ipam", *args)
    client = Ipam(ipam.address)
    client.register("m1", datapath_address="unix:/run/dp-m1.sock")
    channel = grpc.aio.insecure_channel(ipam.address)
    peer = IpamPeer(channel)
    follower = asyncio.create_task(peer.follow_nodes(max_backoff=0.2))
    try:
        await until(lambda: peer.mirror.live)
        node = await peer.node("m1")
        assert node.datapath_address == "unix:/run/dp-m1.sock"
        assert node.pod_cidrs
        assert (peer.mirror.hits, peer.mirror.misses) == (1, 0)

        # The datapath moved: the next lookup after ipam's event sees it.
        client.register("m1", datapath_address="unix:/run/dp-m1-new.sock")
        await until(
            lambda: (peer.mirror.get("m1") or node).datapath_address == "unix:/run/dp-m1-new.sock"
        )
        assert (await peer.node("m1")).pod_cidrs == node.pod_cidrs

        # A node the registry does not have: the mirror misses, ipam says so.
        with pytest.raises(NotFound):
            await peer.node("nobody")
        client.register("m2")  # no datapath yet
        await until(lambda: peer.mirror.get("m2") is not None)
        with pytest.raises(Unavailable, match="no datapath"):
            await peer.node("m2")

        # ipam gone: the mirror stops answering at once.
        ipam.kill9()
        await until(lambda: not peer.mirror.live)
        with pytest.raises(Unavailable):
            await peer.node("m1")
        # Back: a fresh snapshot, the mirror answers again.
        spawn("ipam", *args, port=ipam.port)  # the same port: the channel reconnects
        await until(lambda: peer.mirror.live)
        hits = peer.mirror.hits
        assert (await peer.node("m1")).datapath_address == "unix:/run/dp-m1-new.sock"
        assert peer.mirror.hits == hits + 1
    finally:
        follower.cancel()
        with pytest.raises(asyncio.CancelledError):
            await follower
        await channel.close()
        client.close()


@contextlib.asynccontextmanager
async def synced_mirror(address: str) -> AsyncIterator[IpamPeer]:
    """A peer of the ipam at address whose node mirror follows it (in a task
    group), once the mirror is live."""
    channel = grpc.aio.insecure_channel(address)
    peer = IpamPeer(channel)
    async with TaskGroup("mirror") as tasks:
        tasks.spawn("follow", peer.follow_nodes(max_backoff=0.2))
        await until(lambda: peer.mirror.live)
        yield peer
    await channel.close()


async def test_node_mirror_resumes_after_ipam_restarts_without_a_snapshot(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    args = ipam_args(etcd, "--cluster-cidr", "10.41.0.0/16")
    ipam = spawn("ipam", *args)
    other = spawn("ipam", *args)  # a second replica, for writes while the first is away
    writer = Ipam(other.address)
    writer.register("r1", datapath_address="unix:/run/dp-r1.sock")
    async with synced_mirror(ipam.address) as peer:
        ipam.kill9()
        await until(lambda: not peer.mirror.live)
        # While the replica the mirror follows is away: a new node, a moved one.
        writer.register("r2", datapath_address="unix:/run/dp-r2.sock")
        writer.register("r1", datapath_address="unix:/run/dp-r1-new.sock")
        spawn("ipam", *args, port=ipam.port)
        await until(lambda: peer.mirror.live)
        assert (await peer.node("r2")).datapath_address == "unix:/run/dp-r2.sock"
        assert (await peer.node("r1")).datapath_address == "unix:/run/dp-r1-new.sock"
        # Resumed from the revision it had: no second snapshot.
        assert peer.node_source.snapshots == 1
    writer.close()
