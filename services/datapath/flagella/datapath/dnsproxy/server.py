"""The node's DNS proxy: pods' queries (UDP and TCP port 53, to any
server) arrive here by the BPF's redirect; each is forwarded to the server
the pod asked, and an answer's A/AAAA records are taught to the policy
service (the FQDN cache) and applied on this node before the pod gets the
answer, so its first connection to them is never dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import dns.asyncquery
import dns.exception
import dns.message
import dns.rcode
import dns.rdatatype

from flagella.common.fqdn import canonical_name, matcher
from flagella.datapath.dnsproxy import sockets
from flagella.datapath.dnsproxy.learn import Learned, Taught, learned
from flagella.datapath.flows import DnsRecord, FlowRecord

log = logging.getLogger(__name__)

MAX_UDP = 65535

# datapath.v1 FlowType / FlowVerdict / FlowDirection
FLOW_TYPE_L7 = 5
FORWARDED, DROPPED = 1, 2
EGRESS = 2


@dataclass(frozen=True)
class Asker:
    """The local endpoint a query came from."""

    endpoint: int
    identity: int
    # rules.dns of its policy (names and patterns); empty: any name.
    rules: tuple[str, ...] = ()

    def may_ask(self, name: str) -> bool:
        return not self.rules or any(matcher(k)(name) for k in self.rules)


# endpoint id, what it learned -> once the node applies it (or gives up).
Teach = Callable[[int, list[Learned]], Awaitable[None]]
AskerOf = Callable[[str], Asker | None]
HasIdentity = Callable[[str], bool]
Publish = Callable[[FlowRecord], None]


@dataclass
class ProxyStats:
    """Counts since start (metrics read them)."""

    forwarded: int = 0
    refused: int = 0
    servfail: int = 0
    unparsable: int = 0
    learned: int = 0
    unknown_source: int = 0


class DnsProxy:
    def __init__(
        self,
        port: int,
        asker_of: AskerOf,
        teach: Teach | None,
        has_identity: HasIdentity,
        publish: Publish,
        *,
        upstream_timeout: float = 2.0,
        min_ttl: int = 0,
    ) -> None:
        self.port = port
        self.asker_of = asker_of
        self.publish = publish
        self.teach = teach
        self.has_identity = has_identity
        self.upstream_timeout = upstream_timeout
        self.min_ttl = min_ttl
        self.stats = ProxyStats()
        self.taught = Taught()
        self._udp: list[socket.socket] = []
        self._tcp: list[socket.socket] = []
        self._answers = sockets.AnswerSockets()
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        """Listeners bound and the local routing in place, before the BPF
        is told the port (a redirect with no socket drops)."""
        await sockets.install_routing()
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                self._udp.append(sockets.listener(family, socket.SOCK_DGRAM, self.port))
                self._tcp.append(sockets.listener(family, socket.SOCK_STREAM, self.port))
            except OSError as exc:
                if family == socket.AF_INET:
                    raise
                log.warning("DNS proxy without IPv6", extra={"reason": str(exc)})
        loop = asyncio.get_running_loop()
        for sock in self._udp:
            loop.add_reader(sock.fileno(), self._readable, sock)
        for sock in self._tcp:
            self._servers.append(await asyncio.start_server(self._stream, sock=sock))
        log.info("DNS proxy listening", extra={"port": self.port})

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._udp:
            loop.remove_reader(sock.fileno())
            sock.close()
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        self._answers.close()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- UDP ---

    def _readable(self, sock: socket.socket) -> None:
        space = socket.CMSG_SPACE(32)
        while True:
            try:
                data, anc, _, client = sock.recvmsg(MAX_UDP, space)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("DNS proxy receive failed", extra={"reason": str(exc)})
                return
            server = sockets.original_destination(anc)
            if server is None:
                continue
            self._spawn(self._udp_query(data, (client[0], client[1]), server))

    async def _udp_query(
        self, data: bytes, client: sockets.Address, server: sockets.Address
    ) -> None:
        reply = await self.answer(data, client, server, tcp=False)
        if reply is None:
            return
        try:
            self._answers.for_server(server).sendto(reply, client)
        except OSError as exc:
            log.warning("DNS answer not sent", extra={"reason": str(exc), "server": server[0]})

    # --- TCP ---

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        local = writer.get_extra_info("sockname")  # the server the pod asked
        client, server = (peer[0], peer[1]), (local[0], local[1])
        try:
            while True:
                head = await reader.readexactly(2)
                data = await reader.readexactly(struct.unpack("!H", head)[0])
                reply = await self.answer(data, client, server, tcp=True)
                if reply is None:
                    return  # unparsable: the stream cannot be trusted further
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    # --- one query ---

    async def answer(
        self, data: bytes, client: sockets.Address, server: sockets.Address, *, tcp: bool
    ) -> bytes | None:
        """The reply to one query (None: dropped)."""
        asker = self.asker_of(client[0])
        if asker is None:
            # Only pods' traffic is redirected here: a stray packet.
            self.stats.unknown_source += 1
            return None
        flow = _Flow(self.publish, asker, client, server, tcp)
        query: dns.message.Message | None = None
        try:
            query = dns.message.from_wire(data)
            reason = "" if len(query.question) == 1 else "not one question"
        except dns.exception.DNSException as exc:
            reason = str(exc)[:200] or type(exc).__name__
        if query is None or reason:
            self.stats.unparsable += 1
            log.info(
                "DNS query dropped: unparsable",
                extra={"client": client[0], "server": server[0], "reason": reason},
            )
            flow(DROPPED, DnsRecord(""))
            return None
        question = query.question[0]
        name = canonical_name(question.name.to_text())
        qtypes = (dns.rdatatype.to_text(question.rdtype),)
        if not asker.may_ask(name):
            self.stats.refused += 1
            refused = dns.message.make_response(query)
            refused.set_rcode(dns.rcode.REFUSED)
            flow(DROPPED, DnsRecord(name, rcode=dns.rcode.REFUSED, qtypes=qtypes))
            return refused.to_wire()
        endpoint = asker.endpoint
        try:
            if tcp:
                reply = await dns.asyncquery.tcp(
                    query, server[0], timeout=self.upstream_timeout, port=server[1]
                )
            else:
                reply = await dns.asyncquery.udp(
                    query,
                    server[0],
                    timeout=self.upstream_timeout,
                    port=server[1],
                    ignore_unexpected=True,
                )
        except (dns.exception.DNSException, OSError, EOFError) as exc:
            self.stats.servfail += 1
            log.info(
                "DNS upstream failed: SERVFAIL",
                extra={"server": server[0], "reason": str(exc)[:200] or type(exc).__name__},
            )
            fail = dns.message.make_response(query)
            fail.set_rcode(dns.rcode.SERVFAIL)
            flow(FORWARDED, DnsRecord(name, rcode=dns.rcode.SERVFAIL, qtypes=qtypes))
            return fail.to_wire()
        self.stats.forwarded += 1
        items = learned(reply, self.min_ttl)
        if items and self.teach is not None:
            await self._teach(endpoint, items)
        ips = tuple(ip for i in items if i.name == name for ip in i.ips)
        ttl = next((i.ttl for i in items if i.name == name), 0)
        flow(FORWARDED, DnsRecord(name, ips, ttl, reply.rcode(), qtypes))
        return reply.to_wire()

    async def _teach(self, endpoint: int, items: list[Learned]) -> None:
        assert self.teach is not None
        new = self.taught.new(endpoint, items)
        if not new and all(self.has_identity(ip) for i in items for ip in i.ips):
            # Known already, and still in the ipcache (not deleted since):
            # the entries' TTLs are refreshed meanwhile, when half gone.
            if stale := self.taught.stale(endpoint, items):
                self.taught.add(endpoint, stale)
                self._spawn(self._refresh(endpoint, stale))
            return
        try:
            await self.teach(endpoint, items)
        except Exception as exc:  # the answer still goes out
            log.warning("DNS answer not learned", extra={"reason": str(exc)[:300]})
            return
        self.stats.learned += len(new)
        self.taught.add(endpoint, items)

    async def _refresh(self, endpoint: int, items: list[Learned]) -> None:
        assert self.teach is not None
        try:
            await self.teach(endpoint, items)
        except Exception as exc:  # logged; the next answer retries
            log.warning("DNS cache refresh failed", extra={"reason": str(exc)[:300]})


class _Flow:
    """The L7 flow of one query (Hubble's DNS record), published once."""

    def __init__(
        self,
        publish: Publish,
        asker: Asker,
        client: sockets.Address,
        server: sockets.Address,
        tcp: bool,
    ) -> None:
        self.publish = publish
        self.asker = asker
        self.client = client
        self.server = server
        self.tcp = tcp

    def __call__(self, verdict: int, record: DnsRecord) -> None:
        self.publish(
            FlowRecord(
                time=time.time(),
                type=FLOW_TYPE_L7,
                verdict=verdict,
                drop_reason=0,
                direction=EGRESS,
                src_ip=self.client[0],
                dst_ip=self.server[0],
                src_port=self.client[1],
                dst_port=self.server[1],
                protocol=6 if self.tcp else 17,
                src_identity=self.asker.identity,
                dst_identity=0,
                endpoint_id=self.asker.endpoint,
                ifindex=0,
                dns=record,
            )
        )
