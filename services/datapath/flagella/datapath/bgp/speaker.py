"""This node's BGP speaker: the peering policies and services tables (the
lb's streams) and the node's own registration into the desired speaker
(model.desired), and gobgpd reconciled to it.

The services are followed (a WatchServices stream of the speaker's own)
only while a policy selects the node: a cluster that does not use BGP
costs the lb no second stream per node.

One loop does everything that changes gobgpd, so nothing races: it wakes on
any change of its inputs or when gobgpd exits, computes what is desired and
makes gobgpd so, reading gobgpd's own state each pass (so a gobgpd just
started, adopted after a datapath crash or changed by hand is brought back
to the desired state the same way). A failure (gobgpd not answering, a call
refused) is logged, kept as the speaker's last error, and the pass is
tried again after a backoff; gobgpd dying is restarted after one. Nothing
here ever ends the datapath.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from flagella.api.gobgp.v3 import gobgp_pb2 as g
from flagella.common.backoff import Backoff
from flagella.common.sync import StreamSource, Table
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.datapath.bgp.gobgp import (
    READ_TIMEOUT,
    STATES,
    ExportPolicy,
    GobgpClient,
    Route,
    export_policy_name,
    family_names,
    peer_counts,
    peer_description,
)
from flagella.datapath.bgp.model import (
    AdvertisedService,
    Desired,
    NodeInfo,
    PeeringPolicy,
    desired,
    selected,
)
from flagella.datapath.bgp.supervisor import Gobgpd, GobgpdError

log = logging.getLogger(__name__)

# How long a started (or adopted) gobgpd gets to answer on its socket.
CONNECT_TIMEOUT = 10.0
# A gobgpd that ran this long before it died restarts without waiting.
STABLE_S = 30.0

TABLES: dict[str, g.TableType.ValueType] = {
    "advertised": g.ADJ_OUT,
    "received": g.ADJ_IN,
    "local": g.GLOBAL,
}


@dataclass
class PeerView:
    """One neighbour as GetBgpPeers shows it."""

    address: str
    port: int
    asn: int
    local_asn: int
    state: str
    policy: str
    uptime_s: float = 0.0
    received: int = 0
    accepted: int = 0
    advertised: int = 0
    last_error: str = ""
    hold_time: int = 0
    keep_alive: int = 0
    peer_router_id: str = ""
    families: list[str] = field(default_factory=list)
    has_password: bool = False


@dataclass
class RouteView:
    table: str
    peer: str
    route: Route


class Speaker:
    def __init__(
        self,
        gobgpd: Gobgpd,
        node: NodeInfo,
        policies: Table[str, PeeringPolicy],
        open_services: Callable[
            [Table[int, AdvertisedService]], StreamSource[int, AdvertisedService]
        ],
        *,
        listen_port: int = 179,
        wait_for_node: bool = False,
        tasks: TaskGroup | None = None,
    ) -> None:
        self.gobgpd = gobgpd
        self.node = node
        self.policies = policies
        self.open_services = open_services
        # While a policy selects the node: the services and their stream's tasks.
        self.services: Table[int, AdvertisedService] | None = None
        self._services_tasks: list[asyncio.Task[None]] = []
        self.on_services_synced: Callable[[bool], None] = lambda synced: None
        self.listen_port = listen_port
        # Where the per-gobgpd peer watch runs (the runtime's; tests: own).
        self.tasks = tasks or TaskGroup("bgp")
        self.dirty = asyncio.Event()
        # The node's pod CIDRs come from its registration: none before it.
        self._node_known = asyncio.Event()
        if not wait_for_node:
            self._node_known.set()
        self.desired: Desired | None = None
        self.state = "disabled"
        self.last_error = ""
        self.restarts = 0
        self.backoff = Backoff(0.5, 30.0)
        self.client: GobgpClient | None = None
        self._channel: grpc.aio.Channel | None = None
        self._watcher: asyncio.Task[None] | None = None
        # Per neighbour: why its session is not established, as last seen.
        self.peer_errors: dict[str, str] = {}
        self.peer_states: dict[str, str] = {}
        # What gobgpd refused in the last pass (what -> why): the rest is
        # applied; tried again after a backoff.
        self.refused: dict[str, str] = {}
        self.passes = 0

    # --- inputs ---

    def changed(self) -> None:
        self.dirty.set()

    async def set_node(self, pod_cidrs: Iterable[str], labels: Mapping[str, str]) -> None:
        """The node registry's view of this node: its pod CIDRs and the
        labels node selectors match."""
        node = NodeInfo(
            self.node.name,
            tuple(sorted(labels.items())),
            self.node.ipv4,
            self.node.ipv6,
            tuple(sorted(pod_cidrs)),
        )
        if node != self.node:
            self.node = node
            self.changed()
        self._node_known.set()

    async def follow(self, table: Table[str, PeeringPolicy], on_synced: Callable[[], None]) -> None:
        """The policies' changes wake the loop."""
        async for _ in table.subscribe():
            on_synced()
            self.changed()

    # --- the loop ---

    async def run(self) -> None:
        if self.gobgpd.adopt():
            self.state = "starting"  # running once reconciled
        await self._node_known.wait()
        # Nothing is decided before both streams' first snapshots: a
        # restarted datapath must not stop the gobgpd it adopted for want
        # of policies it has not received yet.
        await self.policies.wait_initialized()
        self.dirty.set()
        while True:
            await self._wait()
            self.dirty.clear()
            if self.gobgpd.pid and not self.gobgpd.running:
                await self._died()
            policies = [p for _, p in self.policies.items()]
            self._follow_services(bool(selected(self.node, policies)))
            if self.services is not None and not self.services.initialized.is_set():
                continue  # its first snapshot wakes the loop
            services = [] if self.services is None else [s for _, s in self.services.items()]
            want = desired(self.node, policies, services, self.listen_port)
            try:
                await self._apply(want)
                self.last_error = ""
                if self.refused:
                    await self._retry_pause()
                    self.dirty.set()
            except (grpc.aio.AioRpcError, GobgpdError, OSError, TimeoutError) as exc:
                reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self.last_error = reason or repr(exc)
                log.warning("BGP speaker not reconciled, will retry", extra={"reason": reason})
                await self._retry_pause()
                self.dirty.set()

    async def _retry_pause(self) -> None:
        """The backoff's delay before reconciling again, cut short when
        gobgpd exits: a dead gobgpd is started again at once, not after a
        refused item's backoff (which grows to 30 s while the item stays
        refused)."""
        delay = self.backoff.next()
        if not self.gobgpd.running:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self.gobgpd.wait_exited()

    def _follow_services(self, on: bool) -> None:
        """Start or stop following the services (a policy selects the node,
        or none does any more)."""
        if on and self.services is None:
            table: Table[int, AdvertisedService] = Table("bgp-services", log_size=LOCAL_LOG_SIZE)
            source = self.open_services(table)
            self.services = table
            self._services_tasks = [
                self.tasks.supervise("stream-bgp-services", source.run),
                self.tasks.supervise(
                    "follow-bgp-services", lambda: self._follow_services_table(table)
                ),
            ]
        elif not on and self.services is not None:
            for task in self._services_tasks:
                task.cancel()
            self.services, self._services_tasks = None, []
            self.on_services_synced(False)

    async def _follow_services_table(self, table: Table[int, AdvertisedService]) -> None:
        async for _ in table.subscribe():
            self.on_services_synced(True)
            self.changed()

    async def _wait(self) -> None:
        if self.dirty.is_set() or (self.gobgpd.pid and not self.gobgpd.running):
            # (a gobgpd that exited while a pass ran: its exit is not
            # waited for below, and nothing else would wake the loop)
            return
        waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.dirty.wait())]
        if self.gobgpd.running:
            waits.append(asyncio.ensure_future(self.gobgpd.wait_exited()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _died(self) -> None:
        ran = time.monotonic() - self.gobgpd.started_at
        self.restarts += 1
        self.state = "restarting"
        self.last_error = f"gobgpd (pid {self.gobgpd.pid}) exited after {ran:.0f} s"
        log.warning("gobgpd died; starting it again", extra={"ran_s": round(ran, 1)})
        await self._disconnect()
        await self.gobgpd.stop()
        if ran >= STABLE_S:
            self.backoff.reset()
        await self.backoff.wait()

    async def _apply(self, want: Desired | None) -> None:
        self.desired = want
        if want is None or not want.asn:
            if self.gobgpd.running:
                log.info("no peering policy applies to this node: stopping gobgpd")
                await self._disconnect()
                await self.gobgpd.stop()
            self.state = "disabled"
            self.refused = {}
            return
        if not self.gobgpd.running:
            self.state = "starting"
            await self.gobgpd.start()
        if self.client is None:
            await self._connect()
        assert self.client is not None
        refused = await reconcile(self.client, want, self.listen_port)
        if refused != self.refused:
            for what, why in sorted(refused.items()):
                log.warning(
                    "gobgpd refused a part of the speaker", extra={"what": what, "reason": why}
                )
        self.refused = refused
        self.state = "running"
        self.passes += 1
        if time.monotonic() - self.gobgpd.started_at >= STABLE_S:
            self.backoff.reset()

    async def _connect(self) -> None:
        """gobgpd answering on its socket within CONNECT_TIMEOUT (else it is
        killed: the next pass starts another). One channel serves every
        gobgpd the speaker runs (the socket's path never changes; gRPC
        connects again by itself): channels closed and made at each restart
        were seen to hold up this process's own server for seconds, as were
        calls waiting for the socket (wait_for_ready)."""
        if self._channel is None:
            # Reconnects within half a second of a new gobgpd (gRPC's own
            # backoff would grow to minutes over a few restarts).
            self._channel = grpc.aio.insecure_channel(
                self.gobgpd.target,
                options=[
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 500),
                ],
            )
        client = GobgpClient(self._channel)
        deadline = time.monotonic() + CONNECT_TIMEOUT
        answered = Backoff(0.05, 0.5)
        while True:
            try:
                await client.stub.GetBgp(g.GetBgpRequest(), timeout=1.0)
                break
            except grpc.aio.AioRpcError as exc:
                if not self.gobgpd.running:
                    raise GobgpdError(f"gobgpd exited: {self.gobgpd.log_tail()}") from exc
                if time.monotonic() >= deadline:
                    self.gobgpd.kill()
                    raise GobgpdError(f"gobgpd does not answer: {exc.details()}") from exc
                await answered.wait()
        self.client = client
        self._watcher = self.tasks.spawn("bgp-peer-events", self._watch_peers(client))

    async def _disconnect(self, *, close: bool = False) -> None:
        """The speaker lets its gobgpd go (the channel stays for the next
        unless close)."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        self.client = None
        if close and self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _watch_peers(self, client: GobgpClient) -> None:
        """Session state changes, for GetBgpPeers' last_error; ends with
        gobgpd (or when the speaker lets it go)."""
        try:
            async for event in client.watch_peers():
                if not event.HasField("peer"):
                    continue
                peer = event.peer.peer
                address = peer.state.neighbor_address or peer.conf.neighbor_address
                state = STATES.get(peer.state.session_state, "unknown")
                was = self.peer_states.get(address)
                self.peer_states[address] = state
                if state == "established":
                    self.peer_errors.pop(address, None)
                elif was == "established":
                    when = time.strftime("%H:%M:%S", time.gmtime())
                    why = self.gobgpd.peer_down_reason(address)
                    self.peer_errors[address] = f"session went down at {when} UTC ({why or state})"
                    log.warning("BGP session down", extra={"peer": address, "state": state})
        except grpc.aio.AioRpcError:
            return

    async def close(self) -> None:
        """The datapath stops: so does its gobgpd (a crash leaves it to be
        adopted)."""
        self._follow_services(False)
        await self._disconnect(close=True)
        await self.gobgpd.stop()

    # --- what the API shows ---

    async def peers(self) -> list[PeerView]:
        want = self.desired
        specs = dict(want.peers) if want else {}
        actual: dict[str, g.Peer] = {}
        if self.client is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                listed = await self.client.list_peers(advertised=True, timeout=READ_TIMEOUT)
                actual = {p.conf.neighbor_address: p for p in listed}
        now = time.time()
        out = []
        for address, spec in sorted(specs.items()):
            view = PeerView(
                address=address,
                port=spec.port,
                asn=spec.asn,
                local_asn=spec.local_asn,
                state="unknown",
                policy=spec.policy,
                has_password=bool(spec.password),
            )
            peer = actual.get(address)
            if peer is not None:
                view.state = STATES.get(peer.state.session_state, "unknown")
                view.received, view.accepted, view.advertised = peer_counts(peer)
                view.families = family_names(peer)
                view.peer_router_id = peer.state.router_id
                timers = peer.timers.state
                if view.state == "established":
                    view.hold_time = int(timers.negotiated_hold_time)
                    view.keep_alive = int(timers.keepalive_interval)
                    if timers.HasField("uptime") and timers.uptime.seconds:
                        view.uptime_s = max(0.0, now - timers.uptime.ToNanoseconds() / 1e9)
            if f"neighbor {address}" in self.refused:
                view.last_error = f"gobgpd refused it: {self.refused[f'neighbor {address}']}"
            elif view.state != "established":
                view.last_error = self.peer_errors.get(address) or (
                    f"not established ({view.state})"
                    if self.client is not None
                    else f"the speaker is {self.state}"
                )
            out.append(view)
        return out

    async def routes(self, table: str, family: str, peer: str) -> list[RouteView]:
        """table: advertised, received, local or "" (advertised and
        received); family: ipv4, ipv6 or "" (both); peer: one or all."""
        if self.client is None:
            return []
        tables = [table] if table else ["advertised", "received"]
        families = [f for f, name in ((4, "ipv4"), (6, "ipv6")) if not family or family == name]
        want = self.desired
        peers = [peer] if peer else sorted(want.peers if want else ())
        out: list[RouteView] = []
        for t in tables:
            for fam in families:
                if t == "local":
                    out += [RouteView(t, r.neighbor, r) for r in await self._routes(t, fam, "")]
                    continue
                for p in peers:
                    if want is not None and p in want.peers and want.peers[p].family != fam:
                        continue  # a neighbour gets only its own family
                    out += [RouteView(t, p, r) for r in await self._routes(t, fam, p)]
        return out

    async def _routes(self, table: str, family: int, peer: str) -> list[Route]:
        assert self.client is not None
        try:
            return await self.client.routes(TABLES[table], family, peer)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.NOT_FOUND):
                return []  # a neighbour gobgpd does not have (yet)
            raise

    async def route_policies(self) -> list[ExportPolicy]:
        if self.client is None:
            return []
        return sorted((await self.client.export_policies()).values(), key=lambda p: p.peer)

    def not_applied(self) -> list[str]:
        """What the policies ask that this node does not do, and why."""
        want = self.desired
        out = list(want.not_applied) if want else []
        return out + [
            f"{what}: gobgpd refused it: {why}" for what, why in sorted(self.refused.items())
        ]

    def advertised_count(self) -> int:
        want = self.desired
        return sum(len(p) for p in want.exports.values()) if want else 0


# gobgpd gone or stuck: the pass ends (and is tried again). Any other refusal
# is of one item (a neighbour gobgpd will not take, say): reported, and the
# rest applied.
UNREACHABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


async def _item(refused: dict[str, str], what: str, call: Awaitable[None]) -> bool:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() in UNREACHABLE:
            raise
        refused[what] = exc.details() or exc.code().name
        return False
    return True


async def reconcile(client: GobgpClient, want: Desired, listen_port: int) -> dict[str, str]:
    """gobgpd made as want says, from what it holds now. Returns what gobgpd
    refused (what -> its reason); everything else is applied."""
    refused: dict[str, str] = {}
    glob = await client.get_global()
    wanted_global = (want.asn, want.router_id, listen_port, sorted(want.listen_addresses))
    have_global = (glob.asn, glob.router_id, glob.listen_port, sorted(glob.listen_addresses))
    if have_global != wanted_global:
        if glob.asn:
            # ASN, router id or listeners changed: everything starts again.
            log.info("BGP speaker restarted with new settings", extra={"asn": want.asn})
            await client.stop()
        await client.start(want.asn, want.router_id, listen_port, want.listen_addresses)
    # Export policies first: a path added later is let out at once.
    have = await client.export_policies()
    wanted = {
        export_policy_name(peer, prefixes): (peer, prefixes)
        for peer, prefixes in want.exports.items()
        if prefixes
    }
    for name, (peer, prefixes) in sorted(wanted.items()):
        if name not in have:
            what = f"export policy of neighbor {peer}"
            if not await _item(refused, what, client.add_export_policy(name, peer, prefixes)):
                del wanted[name]
    assigned, default = await client.assigned_exports()
    if sorted(assigned) != sorted(wanted) or default != g.REJECT:
        await client.set_export_assignment(sorted(wanted))
    for name in sorted(have):
        if name not in wanted:
            await _item(refused, f"old policy {name}", client.delete_export_policy(name))
    resend = {have[n].peer for n in have if n not in wanted} | {
        peer for n, (peer, _) in wanted.items() if n not in have
    }
    # Neighbours.
    actual = {p.conf.neighbor_address: p for p in await client.list_peers()}
    for address, listed in sorted(actual.items()):
        spec = want.peers.get(address)
        stale = spec is None or listed.conf.description != peer_description(spec)
        if stale and await _item(refused, f"neighbor {address}", client.delete_peer(address)):
            del actual[address]
    for address, spec in sorted(want.peers.items()):
        if address not in actual:
            await _item(refused, f"neighbor {address}", client.add_peer(spec, want.asn))
            resend.discard(address)  # a new session gets everything anyway
    # The node's own paths.
    local = await client.local_paths()
    for prefix, hop in sorted(want.paths.items()):
        if prefix not in local or local[prefix].next_hop != hop:
            await _item(refused, f"path {prefix}", client.add_path(prefix, hop))
    for prefix, path in sorted(local.items()):
        if prefix not in want.paths:
            await _item(refused, f"path {prefix}", client.delete_path(path))
    # What a changed export policy lets out now goes out (GoBGP applies a
    # policy change to routes already sent only on a soft reset).
    for address in sorted(resend & set(want.peers)):
        with contextlib.suppress(grpc.aio.AioRpcError):  # not established: nothing to resend
            await client.reset_out(address)
    return refused
