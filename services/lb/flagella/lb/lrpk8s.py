"""CiliumLocalRedirectPolicy objects (cilium.io/v2) into local redirect
policies, when the lb reads Kubernetes (--kubeconfig).

Every replica mirrors the objects into a table (a KubeSource); the replica
holding the lb's Lease (flagella.lb.k8s) writes them to etcd as policies of
source "kubernetes": each term starts with every object, and deletes the
kubernetes policies that have none any more; then each change. An object
the lb refuses is logged and its policy removed (a redirect that no longer
says what its object says is not kept). The API can neither replace nor
delete these, and the watcher touches no policy of the API's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from typing import Any

from flagella.common.backoff import Backoff
from flagella.common.errors import FailedPrecondition, FlagellaError, InvalidArgument
from flagella.common.sync import KubeSource, Table
from flagella.common.sync.kube import Obj
from flagella.lb.lrp import build_lrp, raw_from_cilium
from flagella.lb.lrpstore import LrpStore

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "cilium.io", "v2", "ciliumlocalredirectpolicies"
SOURCE = "kubernetes"


class LrpKubeWatcher:
    def __init__(self, store: LrpStore, *, watch_timeout: int = 60) -> None:
        self.store = store
        self.watch_timeout = watch_timeout
        self.objects: Table[str, Obj] = Table("k8s-lrps")
        self.backoff = Backoff(1.0, 30.0)

    def source(self, api: Any) -> KubeSource[Obj]:
        """The list/watch of every namespace's objects into self.objects."""
        client: Any = importlib.import_module("kubernetes.aio.client")
        custom = client.CustomObjectsApi(api)
        return KubeSource(
            PLURAL,
            functools.partial(
                custom.list_cluster_custom_object_without_preload_content, GROUP, VERSION, PLURAL
            ),
            self.objects,
            watch_timeout=self.watch_timeout,
        )

    async def lead(self) -> None:
        """While this replica leads (cancelled when its term ends): the
        objects into the store, again from a full sync after any failure."""
        while True:
            try:
                async for batch in self.objects.subscribe():
                    keys = {c.key for c in batch.changes}
                    if batch.snapshot:
                        stored, _ = await self.store.list()
                        keys |= {p.key for p in stored if p.source == SOURCE}
                    for key in sorted(keys):
                        await self._sync(key)
                    self.backoff.reset()
            except FlagellaError as exc:
                log.warning(
                    "local redirect policies from kubernetes not synced, will retry",
                    extra={"reason": exc.details},
                )
                await self.backoff.wait()

    async def _sync(self, key: str) -> None:
        namespace, _, name = key.partition("/")
        obj = self.objects.get(key)
        try:
            if obj is not None:
                lrp = build_lrp(raw_from_cilium(obj, source=SOURCE))
                await self.store.put(lrp)
                return
        except InvalidArgument as exc:
            log.warning(
                "CiliumLocalRedirectPolicy refused, its policy removed",
                extra={"lrp": key, "reason": exc.details},
            )
        except FailedPrecondition as exc:  # the API's policy of that name
            log.warning(
                "CiliumLocalRedirectPolicy skipped", extra={"lrp": key, "reason": exc.details}
            )
            return
        with contextlib.suppress(FailedPrecondition):  # the API's: not ours to delete
            await self.store.delete(namespace, name, SOURCE)
