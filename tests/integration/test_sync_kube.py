"""The sync layer's Kubernetes source against a local HTTP server that
speaks the API's list/watch protocol (harness/kube_api.py), through the
real kubernetes.aio client: a paged list then a watch, bookmarks that
advance the revision, a relist after 410 Gone that subscribers get as a
diff, and an API server that restarts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.kube_api import KubeListWatchServer, k8s_endpoint_slice, k8s_service

from flagella.common.sync import KubeSource, Table
from flagella.common.sync.kube import Obj
from flagella.common.tasks import TaskGroup

pytestmark = pytest.mark.integration

PORTS = [{"name": "http", "port": 80, "protocol": "TCP"}]


@pytest.fixture
def kube_api() -> Iterator[KubeListWatchServer]:
    with KubeListWatchServer() as server:
        yield server


@contextlib.asynccontextmanager
async def following(
    kube_api: KubeListWatchServer, tmp_path: Path, *, page_size: int = 500, **kw: Any
) -> AsyncIterator[tuple[Table[str, Any], KubeSource[Any]]]:
    from kubernetes.aio import client, config

    api = await config.new_client_from_config(
        config_file=str(kube_api.write_kubeconfig(tmp_path / "kubeconfig"))
    )
    table: Table[str, Any] = Table("services", keep_prev=True)
    source = KubeSource(
        "services",
        client.CoreV1Api(api).list_service_for_all_namespaces_without_preload_content,
        table,
        page_size=page_size,
        **kw,
    )
    try:
        async with TaskGroup() as tasks:
            tasks.spawn("source", source.run())
            await table.wait_initialized(10)
            yield table, source
    finally:
        await api.close()


def ips(table: Table[str, Obj]) -> dict[str, str]:
    return {key: obj["spec"]["clusterIP"] for key, obj in table.items()}


async def eventually(cond: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_paged_list_then_watch(kube_api: KubeListWatchServer, tmp_path: Path) -> None:
    for i in range(7):
        kube_api.apply("services", k8s_service("ns", f"s{i}", f"10.96.0.{i + 1}", PORTS))
    listed_at = kube_api.apply("endpointslices", k8s_endpoint_slice("ns", "other", "s0", [], []))
    async with following(kube_api, tmp_path, page_size=3) as (table, source):
        # Three pages of one list, at the list's resourceVersion.
        assert ips(table) == {f"ns/s{i}": f"10.96.0.{i + 1}" for i in range(7)}
        assert table.revision == listed_at
        assert table.revision_of("ns/s0") == listed_at - 7
        assert table.get("ns/s3")["metadata"]["name"] == "s3"  # type: ignore[index]
        lists = [r for r in kube_api.requests if "watch=" not in r]
        assert len(lists) == 3
        assert "limit=3" in lists[0]
        assert "continue=" in lists[2]
        assert table.live
        assert source.lists == 1

        sub = table.subscribe()
        first = await sub.next(1)
        assert first is not None
        assert first.snapshot
        assert len(first.changes) == 7

        # Watched: one changed, one deleted, one added; in order.
        kube_api.apply("services", k8s_service("ns", "s1", "10.96.1.1", PORTS))
        kube_api.delete("services", "ns", "s2")
        last = kube_api.apply("services", k8s_service("other", "new", "10.96.1.2", PORTS))
        await table.wait_for(last, 5)
        seen: dict[str, str | None] = {}
        while len(seen) < 3:
            batch = await sub.next(5)
            assert batch is not None
            assert not batch.snapshot
            for c in batch.changes:
                seen[c.key] = None if c.record is None else c.record["spec"]["clusterIP"]
        assert seen == {"ns/s1": "10.96.1.1", "ns/s2": None, "other/new": "10.96.1.2"}
        assert table.revision == last
        assert source.lists == 1


async def test_a_watch_call_that_ends_is_resumed_not_relisted(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    kube_api.apply("services", k8s_service("ns", "a", "10.96.2.1", PORTS))
    async with following(kube_api, tmp_path, watch_timeout=1) as (table, source):
        await eventually(lambda: source.watches >= 3)
        rev = kube_api.apply("services", k8s_service("ns", "b", "10.96.2.2", PORTS))
        await table.wait_for(rev, 5)
        assert set(ips(table)) == {"ns/a", "ns/b"}
        assert source.lists == 1


async def test_bookmarks_advance_the_revision(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    kube_api.apply("services", k8s_service("ns", "a", "10.96.3.1", PORTS))
    async with following(kube_api, tmp_path) as (table, source):
        sub = table.subscribe()
        await sub.next(1)
        # Other kinds move the cluster's resourceVersion on.
        for i in range(3):
            kube_api.apply("endpointslices", k8s_endpoint_slice("ns", f"e{i}", "a", [], []))
        await eventually(lambda: source.watches >= 1)
        await asyncio.sleep(0.2)  # the watch is open
        at = kube_api.bookmark()
        assert await table.wait_for(at, 5) == at
        batch = await sub.next(1)
        assert batch is not None
        assert batch.revision == at
        assert batch.changes == ()
        # The next watch call resumes from the bookmark's resourceVersion.
        assert source.resource_version == str(at)


async def test_410_gone_relists_and_subscribers_get_a_diff(
    kube_api: KubeListWatchServer, tmp_path: Path
) -> None:
    for name in ("a", "b", "c"):
        kube_api.apply("services", k8s_service("ns", name, "10.96.4.1", PORTS))
    async with following(kube_api, tmp_path) as (table, source):
        sub = table.subscribe()
        first = await sub.next(1)
        assert first is not None
        assert first.snapshot
        gone = kube_api.gone_sent
        # The watch ends and its resourceVersion is gone; what changes now
        # only a new list tells.
        kube_api.expire_watches()
        kube_api.apply("services", k8s_service("ns", "a", "10.96.4.9", PORTS))
        kube_api.delete("services", "ns", "b")
        last = kube_api.apply("services", k8s_service("ns", "d", "10.96.4.4", PORTS))
        await table.wait_for(last, 10)
        assert kube_api.gone_sent > gone
        assert source.lists == 2
        changes = {}
        while len(changes) < 3:
            batch = await sub.next(5)
            assert batch is not None
            assert not batch.snapshot
            changes |= {c.key: c for c in batch.changes}
        assert set(changes) == {"ns/a", "ns/b", "ns/d"}
        a, b, d = changes["ns/a"], changes["ns/b"], changes["ns/d"]
        assert a.prev is not None
        assert a.prev["spec"]["clusterIP"] == "10.96.4.1"
        assert a.record is not None
        assert a.record["spec"]["clusterIP"] == "10.96.4.9"
        assert b.record is None
        assert b.prev is not None
        assert d.prev is None
        assert d.record is not None
        assert ips(table) == {"ns/a": "10.96.4.9", "ns/c": "10.96.4.1", "ns/d": "10.96.4.4"}
        assert table.live


async def test_records_decoded_by_the_caller(kube_api: KubeListWatchServer, tmp_path: Path) -> None:

    def cluster_ip(obj: Obj) -> str | None:
        ip = obj["spec"].get("clusterIP")
        return None if ip == "None" else str(ip)  # headless: left out

    kube_api.apply("services", k8s_service("ns", "a", "10.96.6.1", PORTS))
    kube_api.apply("services", k8s_service("ns", "headless", "None", PORTS))
    async with following(kube_api, tmp_path, decode=cluster_ip) as (table, _):
        assert dict(table.items()) == {"ns/a": "10.96.6.1"}
        kube_api.apply("services", k8s_service("ns", "a", "None", PORTS))
        rev = kube_api.apply("services", k8s_service("ns", "b", "10.96.6.2", PORTS))
        await table.wait_for(rev, 5)
        assert dict(table.items()) == {"ns/b": "10.96.6.2"}


async def test_the_api_server_restarts(kube_api: KubeListWatchServer, tmp_path: Path) -> None:
    kube_api.apply("services", k8s_service("ns", "a", "10.96.5.1", PORTS))
    async with following(kube_api, tmp_path) as (table, source):
        kube_api.down()
        await eventually(lambda: not table.live)
        assert "ns/a" in table  # kept while the source is away
        kube_api.apply("services", k8s_service("ns", "b", "10.96.5.2", PORTS))
        await asyncio.sleep(0.5)  # a few failed attempts
        kube_api.up()
        await eventually(lambda: table.live and "ns/b" in table)
        rev = kube_api.apply("services", k8s_service("ns", "c", "10.96.5.3", PORTS))
        await table.wait_for(rev, 5)
        assert set(ips(table)) == {"ns/a", "ns/b", "ns/c"}
        assert source.lists >= 2
