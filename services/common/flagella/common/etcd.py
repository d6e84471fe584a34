"""A typed asyncio etcd v3 client over aetcd: key-value and transactions,
paged reads at one revision, leases kept alive (and replaced, with a
callback, when lost), and range watches that yield whole etcd responses
(what flagella.common.sync builds its tables on).

Every etcd failure surfaces as flagella.common.errors.Unavailable, so callers
answer UNAVAILABLE and nothing is half-written (writes that must be atomic go
through one transaction).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rpc as etcd_rpc
import aetcd.watcher
import grpc

from flagella.common import tls
from flagella.common.backoff import Backoff, retry
from flagella.common.errors import Unavailable
from flagella.common.keepalive import ETCD_CLIENT_TIME, Keepalive
from flagella.common.tasks import TaskGroup

log = logging.getLogger(__name__)

#: The key current_revision() reads (it is never written): a linearizable
#: read needs a key, and with etcd auth on every service may read this one
#: (flagella.common.etcdauth).
REVISION_KEY = "flagella/revision"


#: gRPC codes of a call that failed for want of its etcd member (down, cut
#: off, or without a leader): the next call tries the next endpoint.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def cut_off(endpoint: str) -> Unavailable | None:
    """Inside `except asyncio.CancelledError`: the Unavailable to raise when
    the call was cut off by its channel closing (a failover closed the
    client it ran on: gRPC then cancels its calls), None when the task
    itself is being cancelled (re-raise then)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return None
    return Unavailable(f"etcd call to {endpoint} cut off: the client moved to another member")


class Compacted(Exception):
    """A watch asked for a revision etcd has compacted away."""

    def __init__(self, compacted_revision: int) -> None:
        super().__init__(f"revision compacted below {compacted_revision}")
        self.compacted_revision = compacted_revision


class FutureRevision(Exception):
    """A read asked for a revision etcd has not reached."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision {revision} is in the future")
        self.revision = revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_proto(cls, kv: Any) -> KeyValue:
        return cls(
            key=kv.key.decode(),
            value=kv.value,
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    # For DELETE, value is empty and mod_revision is the deletion's revision.
    kv: KeyValue
    # The key as it was before this event, when the watch asked for prev_kv
    # (None for a creation).
    prev: KeyValue | None = None

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


class StreamKind(enum.Enum):
    """What a snapshot-then-watch stream yields, as the watch RPCs do."""

    RESET = "reset"
    UPSERT = "upsert"
    DELETE = "delete"
    SYNCED = "synced"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    kind: StreamKind
    revision: int
    kv: KeyValue | None = None
    # For deltas of a stream opened with prev_kv: the key before the change.
    prev: KeyValue | None = None


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # One entry per operation that ran; range operations give their kvs.
    ranges: list[list[KeyValue]]


# --- transaction building blocks (etcd's own protos) ---


def _b(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def prefix_end(prefix: str | bytes) -> bytes:
    """The range end covering every key that starts with prefix."""
    raw = bytearray(_b(prefix))
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


def absent(key: str) -> Any:
    """Compare: key does not exist."""
    compare = etcd_rpc.Compare(key=_b(key), target=etcd_rpc.Compare.CREATE)
    # Set although 0 (the default): it selects the oneof etcd compares.
    compare.create_revision = 0
    return compare


def mod_revision_is(key: str, revision: int) -> Any:
    """Compare: key was last modified at revision (0: key absent)."""
    return etcd_rpc.Compare(
        key=_b(key),
        result=etcd_rpc.Compare.EQUAL,
        target=etcd_rpc.Compare.MOD,
        mod_revision=revision,
    )


def prefix_absent(prefix: str) -> Any:
    """Compare: no key starts with prefix (etcd compares every key of the
    range; an empty range compares as one absent key)."""
    return etcd_rpc.Compare(
        key=_b(prefix),
        range_end=prefix_end(prefix),
        result=etcd_rpc.Compare.EQUAL,
        target=etcd_rpc.Compare.CREATE,
        create_revision=0,
    )


def value_is(key: str, value: bytes) -> Any:
    return etcd_rpc.Compare(
        key=_b(key), result=etcd_rpc.Compare.EQUAL, target=etcd_rpc.Compare.VALUE, value=value
    )


def put_op(key: str, value: bytes, lease: int = 0) -> Any:
    # Fields set in place: a PutRequest made apart and copied in costs
    # about three times as much (a bulk of services makes five per service).
    op = etcd_rpc.RequestOp()
    put = op.request_put
    put.key = _b(key)
    put.value = value
    if lease:
        put.lease = lease
    return op


def delete_op(key: str) -> Any:
    op = etcd_rpc.RequestOp()
    op.request_delete_range.key = _b(key)
    return op


def delete_prefix_op(prefix: str) -> Any:
    return etcd_rpc.RequestOp(
        request_delete_range=etcd_rpc.DeleteRangeRequest(
            key=_b(prefix), range_end=prefix_end(prefix)
        )
    )


def get_op(key: str) -> Any:
    op = etcd_rpc.RequestOp()
    op.request_range.key = _b(key)
    return op


def get_prefix_op(prefix: str, *, limit: int = 0, keys_only: bool = False) -> Any:
    """Range op over prefix: at most limit keys (0: all), without values
    when keys_only."""
    return etcd_rpc.RequestOp(
        request_range=etcd_rpc.RangeRequest(
            key=_b(prefix), range_end=prefix_end(prefix), limit=limit, keys_only=keys_only
        )
    )


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """aetcd's client on a channel of ours: over mutual TLS (aetcd only
    dials plaintext; etcd --client-cert-auth takes the user from the
    certificate's CN, so no password or token is sent; the channel follows
    the certificate files when they are replaced, ReloadingChannel), or
    plaintext without files; with the given interceptors either way."""

    _is_connecting: bool
    _connected: asyncio.Event

    def __init__(
        self, files: tls.TlsFiles | None, interceptors: Sequence[Any] = (), **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._files = files
        self._interceptors = list(interceptors)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._files is None:
                self.channel = grpc.aio.insecure_channel(
                    target, options=options, interceptors=self._interceptors
                )
            else:
                self.channel = tls.secure_channel(
                    target, self._files, options=options, interceptors=self._interceptors
                )
            self.kvstub = etcd_rpc.KVStub(self.channel)
            self.clusterstub = etcd_rpc.ClusterStub(self.channel)
            self.leasestub = etcd_rpc.LeaseStub(self.channel)
            self.maintenancestub = etcd_rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                etcd_rpc.WatchStub(self.channel), timeout=self._timeout, metadata=None
            )
            self._connected.set()
        finally:
            self._is_connecting = False


class Etcd:
    """One connection to an etcd cluster (the first endpoint that answers),
    over mutual TLS as the certificate's user when given its files
    (plaintext without: development only)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        tls_files: tls.TlsFiles | None = None,
        interceptors: Sequence[Any] = (),
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls_files = tls_files
        self.interceptors = list(interceptors)
        self._client: aetcd.Client | None = None
        self._endpoint_index = 0

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._endpoint_index]

    def _new_client(self) -> aetcd.Client:
        host, _, port = self.endpoint.rpartition(":")
        kwargs: dict[str, Any] = {
            "host": host.strip("[]"),
            "port": int(port),
            "timeout": self.timeout,
            "options": {
                # Reconnect promptly when etcd comes back; pings as etcd
                # permits them (flagella.common.keepalive).
                **dict(
                    Keepalive(ETCD_CLIENT_TIME, ETCD_CLIENT_TIME / 2).client_options(
                        without_calls=False
                    )
                ),
                # A watch catching up sends up to 1,000 revisions in one
                # response, and a range of many keys can be large: gRPC's
                # default 4 MiB limit breaks both.
                "grpc.max_receive_message_length": 128 << 20,
            },
        }
        return _Client(self.tls_files, self.interceptors, **kwargs)

    @property
    def client(self) -> aetcd.Client:
        if self._client is None:
            self._client = self._new_client()
        return self._client

    async def connect(self) -> int:
        """Check that etcd answers, trying each endpoint once (a readiness
        probe: one member lost is not the cluster lost). Returns the current
        revision. Raises Unavailable."""
        errors = []
        for _ in self.endpoints:
            index = self._endpoint_index
            try:
                return await self.current_revision()
            except Unavailable as exc:
                errors.append(exc.message)
                if self._endpoint_index == index:  # not moved on by _fail_over
                    await self._rotate()
        raise Unavailable("etcd unreachable: " + "; ".join(errors))

    async def wait_connected(self, *, max_delay: float = 5.0) -> int:
        """Retry connect() with backoff until etcd answers."""
        return await retry(
            self.connect,
            what="waiting for etcd",
            retry_on=(Unavailable,),
            backoff=Backoff(0.1, max_delay),
        )

    async def backoff_sleep(self, delay: float) -> bool:
        """A retry loop's sleep of delay seconds, ended early when the
        channel to etcd was down and connects again (gRPC retries it every
        100-500 ms): after an outage a loop resumes when etcd is back, not
        when its backoff runs out. A channel that is up (the failure was
        etcd's answer) sleeps the whole delay. Whether it ended early."""
        client = self.client
        try:
            await self._call(client.connect)  # makes the channel; no request
        except Unavailable:
            await asyncio.sleep(delay)
            return False
        channel = client.channel
        if channel.get_state() == grpc.ChannelConnectivity.READY:
            await asyncio.sleep(delay)
            return False
        try:
            await asyncio.wait_for(channel.channel_ready(), delay)
        except TimeoutError:
            return False
        return True

    async def _fail_over(self, client: aetcd.Client | None, exc: BaseException) -> None:
        """After a call on `client` failed for want of its member (down, cut
        off, or without a leader): the next call goes to the next endpoint
        (the caller retries, as after any Unavailable). Once per failed
        client: the calls in flight when its member died fail together."""
        cause = exc.__cause__ if isinstance(exc, aetcd.exceptions.ClientError) else exc
        lost = isinstance(
            cause,
            aetcd.exceptions.ConnectionFailedError
            | aetcd.exceptions.ConnectionTimeoutError
            | TimeoutError,
        ) or (isinstance(cause, grpc.aio.AioRpcError) and cause.code() in FAILOVER_CODES)
        if lost and client is not None and client is self._client:
            log.info("etcd endpoint failed, trying the next", extra={"endpoint": self.endpoint})
            await self._rotate()

    async def _rotate(self) -> None:
        if len(self.endpoints) > 1:
            await self.close()
            self._endpoint_index = (self._endpoint_index + 1) % len(self.endpoints)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await client.close()

    # --- key-value ---

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        client = self._client
        try:
            return await fn(*args, **kwargs)
        except asyncio.CancelledError:
            if (cut := cut_off(self.endpoint)) is None:
                raise
            raise cut from None
        except Exception as exc:
            error = self._error(exc)
            if error is exc:
                raise
            await self._fail_over(client, exc)
            raise error from exc

    def _error(self, exc: Exception) -> Exception:
        """What a failed call raises: Unavailable for any etcd failure
        (anything else as it is)."""
        if isinstance(
            exc, aetcd.exceptions.ConnectionFailedError | aetcd.exceptions.ConnectionTimeoutError
        ):
            return Unavailable(f"etcd unavailable at {self.endpoint}: {exc}")
        if isinstance(exc, grpc.aio.AioRpcError):
            return Unavailable(f"etcd error at {self.endpoint}: {exc.code().name} {exc.details()}")
        if isinstance(exc, TimeoutError | aetcd.exceptions.InternalError):
            return Unavailable(f"etcd unavailable at {self.endpoint}: {exc!r}")
        if isinstance(exc, aetcd.exceptions.ClientError):
            # aetcd's own methods (get, lease ...) wrap the gRPC error, e.g.
            # PERMISSION_DENIED from etcd's auth: name its code all the same.
            cause = exc.__cause__
            code = cause.code().name if isinstance(cause, grpc.aio.AioRpcError) else "error"
            return Unavailable(f"etcd error at {self.endpoint}: {code} {exc}")
        return exc

    async def current_revision(self) -> int:
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.RangeRequest(key=_b(REVISION_KEY), count_only=True)
        resp = await self._call(
            client.kvstub.Range, req, timeout=self.timeout, metadata=client.metadata
        )
        return int(resp.header.revision)

    async def get(self, key: str) -> KeyValue | None:
        result = await self._call(self.client.get, _b(key))
        return None if result is None else KeyValue.from_proto(result)

    async def get_prefix(
        self, prefix: str, *, keys_only: bool = False
    ) -> tuple[list[KeyValue], int]:
        """Every key under prefix, sorted by key, and the store revision."""
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.RangeRequest(
            key=_b(prefix),
            range_end=prefix_end(prefix),
            keys_only=keys_only,
            sort_order=etcd_rpc.RangeRequest.ASCEND,
            sort_target=etcd_rpc.RangeRequest.KEY,
        )
        resp = await self._call(
            client.kvstub.Range, req, timeout=self.timeout, metadata=client.metadata
        )
        return [KeyValue.from_proto(kv) for kv in resp.kvs], int(resp.header.revision)

    async def get_prefixes(
        self, prefixes: Sequence[str], *, revision: int = 0
    ) -> tuple[list[list[KeyValue]], int]:
        """Every key under each prefix (sorted by key), all read atomically
        at one revision: the current one (revision 0) or an older one still
        in etcd's history. Returns the lists and the revision read. Raises
        Compacted or FutureRevision when that revision cannot be read."""
        client = self.client
        await self._call(client.connect)
        ops = [
            etcd_rpc.RequestOp(
                request_range=etcd_rpc.RangeRequest(
                    key=_b(p),
                    range_end=prefix_end(p),
                    revision=revision,
                    sort_order=etcd_rpc.RangeRequest.ASCEND,
                    sort_target=etcd_rpc.RangeRequest.KEY,
                )
            )
            for p in prefixes
        ]
        req = etcd_rpc.TxnRequest(success=ops)
        try:
            resp = await client.kvstub.Txn(req, timeout=self.timeout, metadata=client.metadata)
        except asyncio.CancelledError:
            if (cut := cut_off(self.endpoint)) is None:
                raise
            raise cut from None
        except (grpc.aio.AioRpcError, TimeoutError, aetcd.exceptions.ClientError) as exc:
            await self._fail_over(client, exc)
            raise self._read_error(exc, revision) from exc
        lists = [[KeyValue.from_proto(kv) for kv in r.response_range.kvs] for r in resp.responses]
        return lists, int(revision or resp.header.revision)

    async def count_prefix(self, prefix: str) -> tuple[int, int]:
        """How many keys start with prefix, and the store revision (etcd
        counts; no key is sent)."""
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.RangeRequest(key=_b(prefix), range_end=prefix_end(prefix), count_only=True)
        resp = await self._call(
            client.kvstub.Range, req, timeout=self.timeout, metadata=client.metadata
        )
        return int(resp.count), int(resp.header.revision)

    def _read_error(self, exc: BaseException, revision: int) -> Exception:
        """What a failed read at a revision raises: Compacted or
        FutureRevision when etcd cannot read that revision, else
        Unavailable."""
        if isinstance(exc, grpc.aio.AioRpcError):
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                details = exc.details() or ""
                if "compacted" in details:
                    return Compacted(revision)
                if "future" in details:
                    return FutureRevision(revision)
            return Unavailable(f"etcd error at {self.endpoint}: {exc.code().name} {exc.details()}")
        return Unavailable(f"etcd unavailable at {self.endpoint}: {exc!r}")

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Returns the revision of the write."""
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.PutRequest(key=_b(key), value=value, lease=lease)
        resp = await self._call(
            client.kvstub.Put, req, timeout=self.timeout, metadata=client.metadata
        )
        return int(resp.header.revision)

    async def delete(self, key: str) -> int:
        """Returns how many keys were deleted (0 or 1)."""
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.DeleteRangeRequest(key=_b(key))
        resp = await self._call(
            client.kvstub.DeleteRange, req, timeout=self.timeout, metadata=client.metadata
        )
        return int(resp.deleted)

    async def delete_prefix(self, prefix: str) -> int:
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.DeleteRangeRequest(key=_b(prefix), range_end=prefix_end(prefix))
        resp = await self._call(
            client.kvstub.DeleteRange, req, timeout=self.timeout, metadata=client.metadata
        )
        return int(resp.deleted)

    async def txn(
        self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> TxnResult:
        """One atomic transaction of compares and operations (see absent(),
        put_op() ...)."""
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.TxnRequest(
            compare=list(compare), success=list(success), failure=list(failure)
        )
        resp = await self._call(
            client.kvstub.Txn, req, timeout=self.timeout, metadata=client.metadata
        )
        ranges = [
            [KeyValue.from_proto(kv) for kv in r.response_range.kvs]
            for r in resp.responses
            if r.WhichOneof("response") == "response_range"
        ]
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), ranges)

    # --- leases ---

    async def grant_lease(self, ttl: int) -> int:
        lease = await self._call(self.client.lease, ttl)
        return int(lease.id)

    async def keepalive_once(self, lease_id: int) -> int:
        """Refreshes a lease; returns its TTL, 0 when it no longer exists."""
        reply = await self._call(self.client.refresh_lease, lease_id)
        return 0 if reply is None else max(int(reply.TTL), 0)

    async def revoke_lease(self, lease_id: int) -> None:
        with contextlib.suppress(aetcd.exceptions.ClientError):
            await self._call(self.client.revoke_lease, lease_id)

    # --- watches ---

    def watch(self, prefix: str, start_revision: int, *, prev_kv: bool = False) -> RangeWatch:
        """A watch of every key under prefix from start_revision on, by whole
        etcd responses (see RangeWatch)."""
        return RangeWatch(self, prefix, prefix_end(prefix), start_revision, prev_kv=prev_kv)

    def watch_keys(
        self,
        key: str,
        range_end: bytes,
        start_revision: int,
        *,
        prev_kv: bool = False,
        on_created: Callable[[], None] | None = None,
    ) -> RangeWatch:
        """As watch(), over the keys in [key, range_end); on_created is
        called when etcd confirms the watch (opening the stream confirms
        nothing: gRPC connects lazily)."""
        return RangeWatch(
            self, key, range_end, start_revision, prev_kv=prev_kv, on_created=on_created
        )

    async def range_pages(
        self, key: str, range_end: bytes, *, revision: int = 0, page_size: int = 1000
    ) -> AsyncIterator[tuple[list[KeyValue], int]]:
        """Every key in [key, range_end), sorted, page by page, all read at
        one revision (the first page's, or the one given): a consistent
        snapshot however large (a single range of 10,000 services would
        pass gRPC's message limit). Yields (kvs, revision). Raises
        Compacted or FutureRevision when that revision cannot be read."""
        start = _b(key)
        while True:
            kvs_lists, read_at = await self._range_at(start, range_end, revision, page_size)
            revision = read_at
            yield kvs_lists, revision
            if len(kvs_lists) < page_size:
                return
            start = kvs_lists[-1].key.encode() + b"\0"

    async def range_unchanged(self, key: str, range_end: bytes, since: int, revision: int) -> bool:
        """Whether no key in [key, range_end) was created, changed or deleted
        after since up to revision: nothing was written at a later mod
        revision and as many keys are there as at since (a deletion would
        need a creation to keep the count). False when either revision
        cannot be read."""
        client = self.client
        await self._call(client.connect)

        def count(at: int) -> Any:
            return etcd_rpc.RequestOp(
                request_range=etcd_rpc.RangeRequest(
                    key=_b(key), range_end=range_end, revision=at, count_only=True
                )
            )

        # etcd counts before applying min_mod_revision: list the keys (names
        # only) written after since instead.
        written = etcd_rpc.RequestOp(
            request_range=etcd_rpc.RangeRequest(
                key=_b(key),
                range_end=range_end,
                revision=revision,
                min_mod_revision=since + 1,
                keys_only=True,
            )
        )
        req = etcd_rpc.TxnRequest(success=[written, count(revision), count(since)])
        try:
            resp = await client.kvstub.Txn(req, timeout=self.timeout, metadata=client.metadata)
        except asyncio.CancelledError:
            if (cut := cut_off(self.endpoint)) is None:
                raise
            raise cut from None
        except (grpc.aio.AioRpcError, TimeoutError, aetcd.exceptions.ClientError) as exc:
            await self._fail_over(client, exc)
            error = self._read_error(exc, since)
            if isinstance(error, Compacted | FutureRevision):
                return False
            raise error from exc
        changed = len(resp.responses[0].response_range.kvs)
        now, before = (int(r.response_range.count) for r in resp.responses[1:])
        return changed == 0 and now == before

    async def _range_at(
        self, start: bytes, range_end: bytes, revision: int, limit: int
    ) -> tuple[list[KeyValue], int]:
        client = self.client
        await self._call(client.connect)
        req = etcd_rpc.RangeRequest(
            key=start,
            range_end=range_end,
            limit=limit,
            revision=revision,
            sort_order=etcd_rpc.RangeRequest.ASCEND,
            sort_target=etcd_rpc.RangeRequest.KEY,
        )
        try:
            resp = await client.kvstub.Range(req, timeout=self.timeout, metadata=client.metadata)
        except asyncio.CancelledError:
            if (cut := cut_off(self.endpoint)) is None:
                raise
            raise cut from None
        except (grpc.aio.AioRpcError, TimeoutError, aetcd.exceptions.ClientError) as exc:
            await self._fail_over(client, exc)
            raise self._read_error(exc, revision) from exc
        return [KeyValue.from_proto(kv) for kv in resp.kvs], int(revision or resp.header.revision)

    async def snapshot_then_watch(
        self,
        prefix: str,
        since_revision: int = 0,
        *,
        max_delay: float = 5.0,
        prev_kv: bool = False,
    ) -> AsyncIterator[StreamEvent]:
        """The watch-stream contract of flagella's Watch* RPCs over the raw
        key-values of one prefix (a table of the prefix served by
        serve_watch: see flagella.common.sync). With prev_kv, each delta
        carries the value the stream had sent for the key in `prev`."""
        from flagella.common.sync.etcd import prefix_stream

        async for event in prefix_stream(
            self, prefix, since_revision, max_delay=max_delay, prev_kv=prev_kv
        ):
            yield event


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """One etcd watch response: whole revisions of changes (etcd never
    splits a revision across responses unless asked to fragment). Every
    change to the watched range up to `revision` has been delivered once
    this batch is."""

    revision: int
    events: list[WatchEvent]


class RangeWatch:
    """A watch on one key range over its own etcd Watch stream, yielding
    whole responses (WatchBatch). (No progress requests: etcd 3.4 answers
    them out of order with events, etcd issue 15220; see
    Etcd.range_unchanged.)

        async with etcd.watch(prefix, start) as watch:
            async for batch in watch: ...

    Raises Compacted when start_revision is gone and Unavailable when the
    stream breaks."""

    def __init__(
        self,
        etcd: Etcd,
        key: str,
        range_end: bytes,
        start_revision: int,
        *,
        prev_kv: bool,
        on_created: Callable[[], None] | None = None,
    ) -> None:
        self.etcd = etcd
        self._on_created = on_created
        self._create = etcd_rpc.WatchRequest(
            create_request=etcd_rpc.WatchCreateRequest(
                key=_b(key), range_end=range_end, start_revision=start_revision, prev_kv=prev_kv
            )
        )
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self._call: Any = None
        self._client: aetcd.Client | None = None

    async def _request_stream(self) -> AsyncIterator[Any]:
        yield self._create
        while True:
            request = await self._requests.get()
            if request is None:
                return
            yield request

    async def __aenter__(self) -> RangeWatch:
        client = self._client = self.etcd.client
        await self.etcd._call(client.connect)
        stub = etcd_rpc.WatchStub(client.channel)
        # As etcd's clientv3.WithRequireLeader: a member cut off from its
        # leader ends the watch (it would otherwise stay silent).
        metadata = (*(client.metadata or ()), ("hasleader", "true"))
        self._call = stub.Watch(self._request_stream(), metadata=metadata)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._requests.put_nowait(None)
        if self._call is not None:
            self._call.cancel()

    def __aiter__(self) -> AsyncIterator[WatchBatch]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[WatchBatch]:
        try:
            async for resp in self._call:
                if resp.compact_revision:
                    raise Compacted(int(resp.compact_revision))
                if resp.canceled:
                    raise Unavailable(f"etcd cancelled the watch: {resp.cancel_reason}")
                if resp.created and self._on_created is not None:
                    self._on_created()
                if not resp.events:
                    continue  # created, or a progress report
                events = [
                    WatchEvent(
                        EventType.PUT if ev.type == ev.PUT else EventType.DELETE,
                        KeyValue.from_proto(ev.kv),
                        KeyValue.from_proto(ev.prev_kv) if ev.HasField("prev_kv") else None,
                    )
                    for ev in resp.events
                ]
                # The header may be ahead of the events while a watch
                # catches up: the events speak for themselves.
                yield WatchBatch(events[-1].revision, events)
        except asyncio.CancelledError:
            if (cut := cut_off(self.etcd.endpoint)) is None:
                raise
            raise cut from None
        except grpc.aio.AioRpcError as exc:
            endpoint = self.etcd.endpoint
            await self.etcd._fail_over(self._client, exc)
            raise Unavailable(
                f"etcd watch broke at {endpoint}: {exc.code().name} {exc.details()}"
            ) from exc
        raise Unavailable(f"etcd watch stream ended at {self.etcd.endpoint}")


class LeaseKeeper:
    """Holds one etcd lease alive. When the lease is lost (etcd was down for
    longer than its TTL), grants a new one and calls on_new_lease(lease_id) so
    the owner can put its keys again."""

    def __init__(
        self,
        etcd: Etcd,
        ttl: int,
        on_new_lease: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.etcd = etcd
        self.ttl = ttl
        self.on_new_lease = on_new_lease
        self.lease_id = 0
        self.tasks = TaskGroup("lease")
        self.healthy = asyncio.Event()

    async def start(self) -> int:
        self.lease_id = await self.etcd.grant_lease(self.ttl)
        self.healthy.set()
        self.tasks.spawn(f"lease-{self.lease_id:x}", self._keep())
        return self.lease_id

    async def _keep(self) -> None:
        interval = max(self.ttl / 3, 0.2)
        while True:
            await asyncio.sleep(interval if self.healthy.is_set() else min(interval, 0.5))
            try:
                remaining = await self.etcd.keepalive_once(self.lease_id)
                if remaining == 0:
                    log.warning(
                        "etcd lease lost, granting a new one", extra={"lease": self.lease_id}
                    )
                    self.lease_id = await self.etcd.grant_lease(self.ttl)
                    if self.on_new_lease is not None:
                        await self.on_new_lease(self.lease_id)
                self.healthy.set()
            except Unavailable as exc:
                if self.healthy.is_set():
                    log.warning("lease keep-alive failed", extra={"reason": exc.message})
                self.healthy.clear()

    async def stop(self, *, revoke: bool = True) -> None:
        await self.tasks.stop()
        if revoke and self.lease_id:
            with contextlib.suppress(Unavailable):
                await self.etcd.revoke_lease(self.lease_id)
