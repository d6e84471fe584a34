"""A table fed by a Kubernetes list/watch (the reflector pattern of
client-go): a paged list at one resourceVersion swapped in whole, a watch
from that resourceVersion with bookmarks, a re-watch from the last
resourceVersion seen when a watch call ends (the API server ends each one
after timeout_seconds), and a fresh list, swapped in as a diff, on 410 Gone
(the resourceVersion left the API server's watch cache) or any other error.

The source speaks HTTP through the `*_without_preload_content` flavour of
a kubernetes.aio list function (e.g.
CoreV1Api.list_service_for_all_namespaces_without_preload_content): it
answers the raw response, which the source reads as JSON itself (no model
objects, and watch lines of any length).

Records are the objects as the API gives them (dicts), keyed
"namespace/name", or what the caller's decode() makes of them.

Revisions: Kubernetes calls resourceVersions opaque strings, but they are
etcd revisions (decimal integers, increasing across every resource of the
cluster) in every API server there is. A numeric resourceVersion is its
int; any other one is one more than the last revision this source saw (a
local counter, in order of arrival). The watch resumes from the string
itself, never from the int.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar, overload

from flagella.common.backoff import Backoff
from flagella.common.sync.table import Sink

log = logging.getLogger(__name__)

R = TypeVar("R")

Obj = Mapping[str, Any]
# A kubernetes.aio list function, without_preload_content flavour.
ListFunction = Callable[..., Awaitable[Any]]


class Gone(Exception):
    """410 Gone: the resourceVersion (or the list's continue token) is too
    old for the API server: list again."""


class KubeError(Exception):
    """The API server answered something other than what was asked."""


def object_key(obj: Obj) -> str:
    """The key of an object: "namespace/name" ("/name" if cluster-scoped)."""
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def resource_version(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def raw_object(obj: Obj) -> Obj:
    return obj


class KubeSource(Generic[R]):
    """Keeps sink (usually a Table) in step with one kind of object of the
    Kubernetes API. run() until cancelled."""

    @overload
    def __init__(
        self: KubeSource[Obj],
        name: str,
        list_function: ListFunction,
        sink: Sink[str, Obj],
        *,
        decode: None = None,
        page_size: int = 500,
        watch_timeout: int = 60,
        backoff: Backoff | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        name: str,
        list_function: ListFunction,
        sink: Sink[str, R],
        *,
        decode: Callable[[Obj], R | None],
        page_size: int = 500,
        watch_timeout: int = 60,
        backoff: Backoff | None = None,
    ) -> None: ...

    def __init__(
        self,
        name: str,
        list_function: ListFunction,
        sink: Sink[str, Any],
        *,
        decode: Callable[[Obj], Any] | None = None,
        page_size: int = 500,
        watch_timeout: int = 60,
        backoff: Backoff | None = None,
    ) -> None:
        self.name = name
        self.list_function = list_function
        self.sink = sink
        # None from decode: the object is left out (as if deleted).
        self.decode: Callable[[Obj], Any] = decode or raw_object
        self.page_size = page_size
        self.watch_timeout = watch_timeout
        self.backoff = backoff or Backoff(0.2, 10.0)
        # The resourceVersion to watch from ("": list first), and its int.
        self.resource_version = ""
        self.revision = 0
        self.lists = 0  # full lists, for tests and status
        self.watches = 0  # watch calls

    def revision_of(self, resource_version: str) -> int:
        """The int revision of a resourceVersion (see the module's doc)."""
        if resource_version.isdigit():
            return int(resource_version)
        return self.revision + 1

    async def run(self) -> None:
        while True:
            try:
                if not self.resource_version:
                    await self.relist()
                await self.watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = "410 Gone" if isinstance(exc, Gone) else f"{exc!r}"[:300]
                # Whatever broke, the next round lists again: a list swapped
                # in as a diff is right whatever was missed.
                self.resource_version = ""
                self.sink.set_live(False, reason)
                delay = self.backoff.next()
                log.warning(
                    "kubernetes list/watch interrupted, listing again",
                    extra={"kind": self.name, "reason": reason, "retry_in_s": delay},
                )
                await asyncio.sleep(delay)

    async def relist(self) -> None:
        """List every object, page by page at the first page's
        resourceVersion, and swap them in."""
        items: list[Obj] = []
        token: str | None = None
        version = ""
        while True:
            doc = await self._get_json(limit=self.page_size, _continue=token)
            meta = doc.get("metadata") or {}
            version = str(meta.get("resourceVersion") or version)
            items += doc.get("items") or []
            token = meta.get("continue") or None
            if token is None:
                break
        revision = self.revision_of(version)
        records: list[tuple[str, Any, int]] = []
        for obj in items:
            record = self.decode(obj)
            if record is not None:
                item_version = resource_version(obj)
                item_revision = int(item_version) if item_version.isdigit() else revision
                records.append((object_key(obj), record, item_revision))
        self.sink.replace(records, revision)
        self.resource_version, self.revision = version, revision
        self.lists += 1
        self.sink.set_live(True)

    async def watch(self) -> None:
        """One watch call from the last resourceVersion, until the API server
        ends it. Raises Gone, KubeError, or the client's errors."""
        resp = await self.list_function(
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            _request_timeout=self.watch_timeout + 30,
        )
        self.watches += 1
        try:
            _check_status(resp.status)
            buffer = b""
            async for data in resp.content.iter_any():
                # The events are newline-delimited JSON; a line can span
                # reads of any size.
                lines = (buffer + data).split(b"\n")
                buffer = lines.pop()
                for line in lines:
                    if line.strip():
                        self._event(json.loads(line))
        finally:
            resp.release()

    def _event(self, event: Obj) -> None:
        kind = event.get("type")
        obj: Obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise Gone(obj.get("message", ""))
            raise KubeError(f"watch error {code}: {obj.get('message', '')}")
        version = resource_version(obj)
        if not version:
            raise KubeError(f"a {kind} event without a resourceVersion")
        revision = self.revision_of(version)
        if kind == "BOOKMARK":
            self.sink.advance(revision)
        elif kind in ("ADDED", "MODIFIED", "DELETED"):
            record = None if kind == "DELETED" else self.decode(obj)
            self.sink.commit([(object_key(obj), record, revision)], revision)
        else:
            raise KubeError(f"unknown watch event type {kind!r}")
        self.resource_version, self.revision = version, max(self.revision, revision)
        self.backoff.reset()

    async def _get_json(self, **query: Any) -> Obj:
        resp = await self.list_function(**query, _request_timeout=30)
        try:
            _check_status(resp.status)
            doc: Obj = json.loads(await resp.read())
        finally:
            resp.release()
        return doc


def _check_status(status: int) -> None:
    if status == 410:
        raise Gone("HTTP 410")
    if status != 200:
        raise KubeError(f"the API server answered HTTP {status}")
