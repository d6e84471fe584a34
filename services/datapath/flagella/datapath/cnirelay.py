"""The node's CNI socket. flagella-cni talks only to its own node: to this
datapath, over a unix socket that only root can open (mode 0600 in a
root-owned folder; the peer's uid is checked as well). Each invocation is
relayed to the endpoint service as one Cni call under the node's identity
(the node is this datapath's, never the plugin's to say), and the answer is
what the plugin prints. One JSON object a line each way (the plugin's side:
flagella/cni/__main__.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import struct
from typing import Any

import grpc

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc

log = logging.getLogger(__name__)

# A request is the CNI environment and a network configuration (a few KiB).
MAX_REQUEST = 1 << 20
DEFAULT_TIMEOUT_S = 30.0
# The longest a network config may ask for (flagella.cni.MAX_TIMEOUT_S).
MAX_TIMEOUT_S = 3600.0
# How long an invocation waits for the channel to the endpoint service to
# (re)connect before it is "try again later": longer than the channel's
# reconnect backoff (2 s at most), so a restarted service is found again.
CONNECT_S = 3.0
# The strings of a request, and the CNI variables they carry.
FIELDS = ("command", "container_id", "netns", "ifname", "args", "path", "config")
RETRY_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


class UnsafeSocket(Exception):
    """The socket's folder would let someone other than root in."""


def bind_private(path: str) -> socket.socket:
    """A unix socket at path that only this process's user (root) may open:
    created under umask 0177 (never a moment with a wider mode), then
    chmod 0600, in a folder owned by that user that nobody else may write."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o755, exist_ok=True)
    info = os.stat(folder)
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeSocket(
            f"{folder} must be owned by uid {os.geteuid()} and writable by it alone "
            f"(owner {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})"
        )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket from a crashed run
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def failure(error: str, details: str, *, retry: bool) -> dict[str, Any]:
    """An answer the plugin turns into a CNI error: try again later (retry)
    or a failure."""
    return {"error": error, "details": details, "retry": retry}


class CniRelay:
    def __init__(self, path: str, node: str, endpoint_address: str, channel: grpc.aio.Channel):
        self.path = path
        self.node = node
        self.endpoint_address = endpoint_address
        self.channel = channel
        self.endpoint = endpoint_pb2_grpc.EndpointServiceStub(channel)
        self._server: asyncio.AbstractServer | None = None
        self._inode = 0

    async def open(self) -> None:
        """Bind the socket and serve it (OSError, UnsafeSocket: cannot)."""
        sock = bind_private(self.path)
        self._inode = os.stat(self.path).st_ino
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_REQUEST)
        log.info("serving flagella-cni", extra={"socket": self.path, "node": self.node})

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        self._server = None
        # Only our own socket: a successor may have bound the path already.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                # Read first even from a peer to refuse: closing on unread
                # data would reset the connection before it has the answer.
                line = await reader.readline()
            except ValueError:  # longer than MAX_REQUEST
                line = b""
            uid = peer_uid(writer)
            if uid != os.geteuid():
                log.warning("CNI socket: peer refused", extra={"uid": uid, "socket": self.path})
                answer = failure(f"uid {uid} may not use {self.path}", "", retry=False)
            elif not line.endswith(b"\n"):
                answer = failure("the datapath cannot read the request", "", retry=False)
            else:
                answer = await self.relay(line)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the plugin went away; the endpoint service rolls back what it began
        finally:
            writer.close()

    async def relay(self, line: bytes) -> dict[str, Any]:
        """One request line: the plugin's answer."""
        try:
            req = json.loads(line)
        except ValueError as exc:
            return failure("the datapath cannot read the request", str(exc), retry=False)
        if not isinstance(req, dict) or not all(isinstance(req.get(f, ""), str) for f in FIELDS):
            return failure("the datapath cannot read the request", "bad fields", retry=False)
        timeout = req.get("timeout", DEFAULT_TIMEOUT_S)
        # Not `timeout <= 0`: NaN and infinity pass that, and no deadline is either.
        bad = not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
        if bad or not 0 < timeout <= MAX_TIMEOUT_S:
            timeout = DEFAULT_TIMEOUT_S
        netns = req.get("netns", "")
        request = endpoint_pb2.CniRequest(
            command=req.get("command", ""),
            container_id=req.get("container_id", ""),
            netns=netns,
            ifname=req.get("ifname", ""),
            args=req.get("args", ""),
            path=req.get("path", ""),
            config=req.get("config", "").encode(),
            # Only the node sees its netns (the endpoint service runs elsewhere).
            netns_exists=bool(netns) and os.path.exists(netns),
            node=self.node,
        )
        where = f"endpoint service at {self.endpoint_address}"
        if self.channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            try:
                await asyncio.wait_for(self.channel.channel_ready(), min(timeout, CONNECT_S))
            except TimeoutError:
                return failure(f"{where} unavailable, try again later", "not connected", retry=True)
        try:
            resp = await self.endpoint.Cni(request, timeout=float(timeout), wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            retry = code in RETRY_CODES
            error = (
                f"{where} unavailable, try again later"
                if retry
                else f"{request.command} failed at the {where}: {code.name}"
            )
            return failure(error, exc.details() or "", retry=retry)
        return {"exit": resp.exit_code, "stdout": resp.stdout.decode()}
