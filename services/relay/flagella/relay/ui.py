"""The flows web page (as Hubble UI): static files shipped in the package
(ui/: plain HTML, JS, CSS and SVG; no build step, nothing fetched from
elsewhere) and the live flows as Server-Sent Events, read in-process from
the relay's one merged stream (Relay.observe) and shaped as `flagella
observe -o json` prints them (flagella.common.flows).

No authentication, as Hubble UI: whoever reaches the port sees every
flow. It binds to loopback by default (reached by port-forward); a
request must name the page by an IP address, localhost or an allowed
host (a web page elsewhere cannot rebind a name of its own to it).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Protocol

from aiohttp import web

from flagella.api.datapath.v1 import datapath_pb2
from flagella.common import flows as hubble
from flagella.common.errors import FlagellaError
from flagella.common.metrics import HttpSite
from flagella.relay.service import Event, Lost, NodeStatus, Relay

log = logging.getLogger(__name__)

FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/app.css": ("app.css", "text/css; charset=utf-8"),
}
HEADERS = {
    # Only the page's own files and its own API; no inline script.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label
MAX_LAST = 10_000
DEFAULT_LAST = 500


class Directory(Protocol):
    """Names the ends of flows (peers.Names)."""

    error: str

    async def of(self, f: datapath_pb2.Flow | None = None) -> hubble.Directory: ...


class BadQuery(Exception):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def sse(kind: str, data: Any) -> bytes:
    """One Server-Sent Event (JSON on one line: no newline inside)."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def parse_query(query: Any) -> tuple[str, int]:
    """(namespace, last) of /api/flows?namespace=&last=."""
    namespace = query.get("namespace", "")
    if namespace and not NAMESPACE.fullmatch(namespace):
        raise BadQuery("namespace", f"{namespace[:80]!r} is not a namespace name")
    raw = query.get("last", str(DEFAULT_LAST))
    if not raw.isdigit() or int(raw) > MAX_LAST:
        raise BadQuery("last", f"{raw[:20]!r}: a count of flows, 0 to {MAX_LAST}")
    return namespace, int(raw)


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request's Host names the page: an IP address, localhost,
    or a name the operator allowed."""
    name = urllib.parse.urlsplit(f"//{host}").hostname or ""
    if name in ("localhost", *allowed):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class FlowsPage:
    """The page's HTTP server; `clients` counts the open flow streams."""

    def __init__(
        self,
        relay: Relay,
        names: Directory,
        address: str,
        allowed_hosts: tuple[str, ...] = (),
    ) -> None:
        self.relay = relay
        self.names = names
        self.address = address
        self.allowed_hosts = tuple(h.lower() for h in allowed_hosts)
        self.clients = 0
        # handler_cancellation: a browser that leaves ends its flow stream.
        self._site = HttpSite("flows page", address, handler_cancellation=True)
        ui = resources.files("flagella.relay") / "ui"
        self._files = {path: (ui / name).read_bytes() for path, (name, _) in FILES.items()}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        for path in FILES:
            app.router.add_get(path, self._file)
        app.router.add_get("/api/flows", self._flows)
        app.router.add_get("/api/namespaces", self._namespaces)
        app.router.add_get("/api/nodes", self._nodes)
        return app

    @property
    def port(self) -> int:
        return self._site.port

    async def start(self) -> None:
        await self._site.start(self.app())

    async def stop(self) -> None:
        await self._site.stop()

    @web.middleware
    async def _guard(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        if not host_allowed(request.host, self.allowed_hosts):
            return web.json_response(
                {"error": f"host: {request.host[:80]!r} is not this page's address"}, status=421
            )
        response = await handler(request)
        if not response.prepared:  # a stream sent its own already
            response.headers.update(HEADERS)
        return response

    async def _file(self, request: web.Request) -> web.Response:
        _, content_type = FILES[request.path]
        return web.Response(body=self._files[request.path], headers={"Content-Type": content_type})

    async def _namespaces(self, request: web.Request) -> web.Response:
        directory = await self.names.of()
        namespaces = sorted({p.namespace for p in directory.pods.values() if p.namespace})
        return web.json_response({"namespaces": namespaces, "error": self.names.error})

    async def _nodes(self, request: web.Request) -> web.Response:
        state = {True: "CONNECTED", False: "UNAVAILABLE", None: "UNKNOWN"}
        nodes = [
            {"name": v.name, "state": state[v.connected], "flows_seen": v.flows_seen}
            for v in self.relay.node_views()
        ]
        return web.json_response({"nodes": nodes})

    async def _flows(self, request: web.Request) -> web.StreamResponse:
        try:
            namespace, last = parse_query(request.query)
        except BadQuery as exc:
            return web.json_response({"error": str(exc), "field": exc.field}, status=400)
        wanted = hubble.EndFilter(namespaces=(namespace,) if namespace else ())
        response = web.StreamResponse(headers={**HEADERS, "Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.clients += 1
        try:
            await response.write(b"retry: 2000\n\n")
            req = datapath_pb2.ObserveFlowsRequest(follow=True, last=last)
            async for event in self.relay.observe(req, ()):
                out = await self._event(event, wanted)
                if out:
                    await response.write(out)
        except FlagellaError as exc:
            # The registry away: said on the page, which reconnects.
            await response.write(sse("failure", {"message": exc.details, "time": _now()}))
        except ConnectionError:
            pass  # the browser went away
        finally:
            self.clients -= 1
        return response

    async def _event(self, event: Event, wanted: hubble.EndFilter) -> bytes:
        if isinstance(event, NodeStatus):
            return sse(
                "node_status",
                hubble.node_status(event.node, event.connected, event.message, _now()),
            )
        if isinstance(event, Lost):
            return sse("lost_events", hubble.lost_events(event.node, event.count, _now()))
        shape = hubble.to_hubble(event, await self.names.of(event))
        return sse("flow", shape) if wanted.matches(shape) else b""
