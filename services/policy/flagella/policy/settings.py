"""Settings of the policy service's logic (from PolicyConfig:
flagella.policy.__main__.settings_of)."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.sync.table import WATCH_LOG_SIZE
from flagella.policy.resolve import DEFAULT_BUDGET


@dataclass(frozen=True)
class Settings:
    node_lease_ttl: int = 900
    keys_per_lease: int = 1000
    gc_interval: float = 15.0
    budget: int = DEFAULT_BUDGET
    allow_localhost: bool = True
    # --k8s-ipblock-mode=kubernetes: NetworkPolicy ipBlocks match pods too.
    k8s_ipblocks: bool = True
    label_filter: tuple[str, ...] | None = None
    watch_heartbeat: float = 30.0
    # SYNCEDs per second, every WatchPolicy stream together, for revisions
    # that touch nothing of a stream's node (--watch-quiet-sync-rate).
    watch_quiet_sync_rate: float = 1000.0
    wait_timeout: float = 10.0
    # Changes each table served to watches keeps (--watch-history).
    watch_history: int = WATCH_LOG_SIZE
