"""Runtime configuration (flagella.common.runtimeconfig has the options): the
cluster's values and each node's overrides in etcd, mirrored into a table of
this replica (its own EtcdSource: the policy mirror ignores these keys),
patched with a revision check, and followed by every datapath (WatchConfig).

flagella/policy/v1/config/cluster          {"option": "value", ...}
flagella/policy/v1/config/nodes/<node>     the node's overrides

The policy service owns it: enforcement and audit are policy options, its
grant already covers flagella/policy/v1/, and every datapath already follows
its streams (the datapath holds no etcd credentials).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass

from flagella.common import runtimeconfig as rc
from flagella.common.errors import Aborted, Unavailable
from flagella.common.etcd import Etcd, KeyValue, delete_op, mod_revision_is, put_op
from flagella.common.sync import Batch, Change, EtcdSource, Subscription, Table, serve_watch
from flagella.common.sync.table import WATCH_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.policy import keys
from flagella.policy.streams import EventKind

log = logging.getLogger(__name__)

PREFIX = keys.CONFIG_PREFIX
CLUSTER_KEY = PREFIX + "cluster"
NODES_PREFIX = PREFIX + "nodes/"
CLUSTER = ""  # the table key of the cluster's values

Values = dict[str, str]


def etcd_key(scope: str) -> str:
    return CLUSTER_KEY if scope == CLUSTER else NODES_PREFIX + scope


class ConfigCodec:
    def key(self, key: str) -> str | None:
        if key == CLUSTER_KEY:
            return CLUSTER
        node = key.removeprefix(NODES_PREFIX)
        return node if node != key and node else None

    def decode(self, key: str, kv: KeyValue) -> Values | None:
        try:
            value = json.loads(kv.value)
            if isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                return value
        except ValueError:
            pass
        log.error("ignoring an unreadable runtime configuration", extra={"key": kv.key})
        return None


@dataclass(frozen=True)
class ConfigView:
    """GetConfig's answer for a node (or the cluster: node empty)."""

    node: str
    cluster: Values
    overrides: Values
    cluster_revision: int
    node_revision: int

    def options(self) -> list[tuple[rc.OptionSpec, str, str]]:
        """Every option with its value and its source."""
        values = rc.effective(self.cluster, self.overrides)
        return [(spec, *values.get(spec.name, ("", ""))) for spec in rc.OPTIONS]


class RuntimeConfig:
    def __init__(
        self,
        etcd: Etcd,
        *,
        wait_timeout: float,
        heartbeat: float,
        watch_history: int = WATCH_LOG_SIZE,
    ) -> None:
        self.etcd = etcd
        # (What WatchConfig streams.)
        self.table: Table[str, Values] = Table("runtime-config", log_size=watch_history)
        self.source = EtcdSource(
            etcd, self.table, ConfigCodec(), prefix=PREFIX, name="runtime-config"
        )
        self.wait_timeout = wait_timeout
        self.heartbeat = heartbeat

    def start(self, tasks: TaskGroup) -> None:
        tasks.supervise("runtime-config", self.source.run)

    async def view(self, node: str) -> ConfigView:
        t = self.table
        try:
            await t.wait_initialized(self.wait_timeout)
        except TimeoutError:
            raise Unavailable("the runtime configuration is not read from etcd yet") from None
        return ConfigView(
            node,
            dict(t.get(CLUSTER) or {}),
            dict(t.get(node) or {}) if node else {},
            t.revision_of(CLUSTER) if CLUSTER in t else 0,
            t.revision_of(node) if node and node in t else 0,
        )

    async def patch(
        self, node: str, values: Mapping[str, str], reset: Iterable[str], expected_revision: int
    ) -> ConfigView:
        """Sets and resets options of one scope in one transaction; ABORTED
        when the scope is not at expected_revision (0: no check) or changed
        meanwhile. Answers once this replica's table has the write."""
        reset = list(reset)
        rc.validate_patch(values, reset)
        key = etcd_key(node)
        kv = await self.etcd.get(key)
        current = (ConfigCodec().decode(node, kv) or {}) if kv is not None else {}
        revision = kv.mod_revision if kv is not None else 0
        if expected_revision and expected_revision != revision:
            raise Aborted(
                f"the configuration is at revision {revision}, not {expected_revision}",
                field="expected_revision",
            )
        wanted = {k: v for k, v in current.items() if k not in reset} | dict(values)
        op = put_op(key, json.dumps(wanted, sort_keys=True).encode()) if wanted else delete_op(key)
        result = await self.etcd.txn([mod_revision_is(key, revision)], [op])
        if not result.succeeded:
            raise Aborted("the configuration changed meanwhile: read it again", field="node")
        try:
            await self.table.wait_for(result.revision, self.wait_timeout)
        except TimeoutError:
            raise Unavailable("the write is not visible yet; read it again") from None
        return await self.view(node)

    def watch(self, node: str, since: int) -> AsyncIterator[ConfigEvent]:
        """The cluster's values and the node's overrides, each sent whole
        on a change (serve_watch's contract: RESET, UPSERTs, SYNCED, then
        changes, each batch closed by SYNCED)."""
        return serve_watch(
            _NodeFeed(self.table.subscribe(since), node),
            _Messages(),
            since=since,
            heartbeat=self.heartbeat,
            sync_batches=True,
        )


class _NodeFeed:
    """A subscription narrowed to the cluster's key and one node's."""

    def __init__(self, sub: Subscription[str, Values], node: str) -> None:
        self.sub = sub
        self.keys = {CLUSTER, node}

    async def next(self, timeout: float | None = None) -> Batch[str, Values] | None:
        batch = await self.sub.next(timeout)
        if batch is None:
            return None
        changes = tuple(c for c in batch.changes if c.key in self.keys)
        return Batch(batch.revision, changes, batch.snapshot)


@dataclass(frozen=True)
class ConfigEvent:
    kind: str  # EventKind
    revision: int
    scope: str = ""
    values: Values | None = None


class _Messages:
    def reset(self, revision: int) -> ConfigEvent:
        return ConfigEvent(EventKind.RESET, revision)

    async def upsert(self, change: Change[str, Values]) -> ConfigEvent:
        return ConfigEvent(EventKind.UPSERT, change.revision, change.key, change.record)

    async def delete(self, change: Change[str, Values]) -> ConfigEvent:
        return ConfigEvent(EventKind.DELETE, change.revision, change.key)

    def synced(self, revision: int) -> ConfigEvent:
        return ConfigEvent(EventKind.SYNCED, revision)
