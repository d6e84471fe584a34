"""The node's runtime configuration (flagella.common.runtimeconfig): the
policy service's WatchConfig stream mirrored into a table (the cluster's
values under "", this node's overrides under its name), applied live to the
datapath on every change (no restart). Until the first answer, and whenever
the values cannot be read, the defaults hold: policy enforced as the rules
say, no audit."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from flagella.api.policy.v1 import policy_pb2
from flagella.common.runtimeconfig import RuntimeOptions
from flagella.common.sync import Table

log = logging.getLogger(__name__)

Values = dict[str, str]


class ConfigCodec:
    """WatchConfig events -> scope: its values."""

    def key(self, event: policy_pb2.ConfigEvent) -> str:
        return event.scope

    def decode(self, event: policy_pb2.ConfigEvent) -> Values:
        return dict(event.values)


async def follow(
    table: Table[str, Values],
    node: str,
    apply: Callable[[RuntimeOptions], Awaitable[None]],
    synced: Callable[[], None],
) -> None:
    """Applies the options the table says after each of its batches."""
    async for _ in table.subscribe():
        opts = RuntimeOptions.of(table.get("") or {}, table.get(node) or {})
        await apply(opts)
        synced()
