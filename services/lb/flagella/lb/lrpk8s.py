"""CiliumLocalRedirectPolicy objects (cilium.io/v2) into local redirect
policies of source "kubernetes", when the lb reads Kubernetes
(--kubeconfig): followed as crdwatch.py says (every namespace's objects,
written by the replica holding the lb's Lease; an object the lb refuses is
logged and its policy removed; the API's policies are never touched)."""

from __future__ import annotations

from flagella.common.sync.kube import Obj
from flagella.lb.crdwatch import SOURCE, CustomResourceWatcher
from flagella.lb.lrp import build_lrp, raw_from_cilium
from flagella.lb.lrpstore import LrpStore


class LrpKubeWatcher(CustomResourceWatcher):
    GROUP, VERSION, PLURAL = "cilium.io", "v2", "ciliumlocalredirectpolicies"
    KIND = "CiliumLocalRedirectPolicy"
    NOUN, NOUNS, LOG_KEY = "policy", "local redirect policies", "lrp"

    def __init__(self, store: LrpStore, *, watch_timeout: int = 60) -> None:
        super().__init__("k8s-lrps", watch_timeout=watch_timeout)
        self.store = store

    async def _stored_keys(self) -> set[str]:
        stored, _ = await self.store.list()
        return {p.key for p in stored if p.source == SOURCE}

    async def _put(self, obj: Obj) -> None:
        await self.store.put(build_lrp(raw_from_cilium(obj, source=SOURCE)))

    async def _delete(self, key: str) -> None:
        namespace, _, name = key.partition("/")
        await self.store.delete(namespace, name, SOURCE)
