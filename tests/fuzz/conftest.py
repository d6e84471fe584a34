"""The control plane every non-kernel fuzz test calls: one set of processes
for the whole folder (fuzzing resets nothing between methods)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fuzzing import UNAVAILABLE, Fuzzer, Plane, stop_followers_first
from harness.cluster import standalone_cluster


@pytest.fixture(scope="package")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """etcd, ipam, policy, lb, endpoint and the relay, as real processes
    with mutual TLS; a Fuzzer that snapshots etcd's `flagella/` keys."""
    with standalone_cluster(tmp_path_factory.mktemp("fuzz")) as cluster:
        cluster.start(services=("ipam", "policy", "lb", "endpoint"))
        ipam = cluster.services["ipam"].address
        cluster.services["relay"] = cluster.spawn("relay", "--ipam-address", ipam)
        loop = asyncio.new_event_loop()
        etcd = cluster.etcd.client()

        async def keys() -> dict[str, Any]:
            kvs, _ = await etcd.get_prefix("flagella/")
            return {kv.key: (kv.value, kv.lease) for kv in kvs}

        addresses = {svc: proc.address for svc, proc in cluster.services.items()}
        fuzzer = Fuzzer(addresses, [keys], UNAVAILABLE)
        try:
            yield Plane(cluster, fuzzer, loop)
        finally:
            loop.run_until_complete(fuzzer.close())
            loop.run_until_complete(etcd.close())
            loop.close()
            stop_followers_first(cluster)
