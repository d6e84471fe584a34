"""Identity churn at small scale (bench/identity_churn.py's engine): held
identities, pods with unique labels created and deleted at a steady rate
through a real policy process and etcd, secure as the endpoint service
calls it. The garbage stays bounded while it runs, no identity in use is
ever collected or remapped, and at the end the GC has freed exactly the
churned ones."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from harness.etcd import EtcdServer
from harness.idchurn import IdentityChurn
from harness.procs import ServiceProcess

pytestmark = [pytest.mark.integration]

HELD = 300
RATE = 50.0
SECONDS = 4.0
GC_INTERVAL = 0.5


async def test_gc_keeps_up_with_churn_and_never_collects_an_identity_in_use(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    proc = spawn(
        "policy", "--etcd-endpoints", etcd.endpoint, "--identity-gc-interval", str(GC_INTERVAL)
    )
    churn = IdentityChurn(proc, etcd, concurrency=8)
    result = await churn.run(HELD, RATE, SECONDS, lifetime=0.3)
    await churn.drain(timeout=20)
    figures = result.figures()
    assert result.errors == []
    assert result.lost == []  # every held and live identity: same id, same labels, referenced
    assert result.created == result.deleted == int(RATE * SECONDS)
    # Garbage lives about two GC rounds: far fewer than the pods churned
    # (without GC it would reach all 200 of them).
    assert figures["gc_runs_count"] >= 3
    assert 0 < figures["garbage_max_count"] <= result.created // 2, figures
    # Then GC frees exactly the churned identities: the held ones stay.
    assert result.drained_s is not None, figures
    assert result.etcd_keys["drained"] == result.etcd_keys["held"]
