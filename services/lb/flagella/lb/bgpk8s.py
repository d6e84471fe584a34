"""CiliumBGPPeeringPolicy objects (cilium.io/v2alpha1) into BGP peering
policies, when the lb reads Kubernetes (--kubeconfig).

Every replica mirrors the objects into a table (a KubeSource); the replica
holding the lb's Lease (flagella.lb.k8s) writes them to etcd as policies of
source "kubernetes": each term starts with every object, and deletes the
kubernetes policies that have none any more; then each change. A
neighbour's authSecretRef names a Secret of --bgp-secrets-namespace whose
key "password" is read when its object is synced. An object the lb refuses
is logged and its policy removed (a peering that no longer says what its
object says is not kept). The API can neither replace nor delete these, and
the watcher touches no policy of the API's.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import importlib
import logging
from typing import Any

from flagella.common.backoff import Backoff
from flagella.common.errors import FailedPrecondition, FlagellaError, InvalidArgument, Unavailable
from flagella.common.sync import KubeSource, Table
from flagella.common.sync.kube import Obj
from flagella.lb.bgp import build_policy, raw_from_cilium, secret_refs
from flagella.lb.bgpstore import BgpPolicyStore

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "cilium.io", "v2alpha1", "ciliumbgppeeringpolicies"
SOURCE = "kubernetes"


class BgpKubeWatcher:
    def __init__(
        self, store: BgpPolicyStore, secrets_namespace: str, *, watch_timeout: int = 60
    ) -> None:
        self.store = store
        self.secrets_namespace = secrets_namespace
        self.watch_timeout = watch_timeout
        self.objects: Table[str, Obj] = Table("k8s-bgp-policies")
        self.backoff = Backoff(1.0, 30.0)
        self._core: Any = None

    def source(self, api: Any) -> KubeSource[Obj]:
        """The list/watch of every object into self.objects."""
        client: Any = importlib.import_module("kubernetes.aio.client")
        custom = client.CustomObjectsApi(api)
        self._core = client.CoreV1Api(api)
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
                        # Cluster-scoped: the objects' keys are "/<name>".
                        keys |= {f"/{p.name}" for p in stored if p.source == SOURCE}
                    for key in sorted(keys):
                        await self._sync(key)
                    self.backoff.reset()
            except FlagellaError as exc:
                log.warning(
                    "BGP peering policies from kubernetes not synced, will retry",
                    extra={"reason": exc.details},
                )
                await self.backoff.wait()

    async def _password(self, name: str) -> str | None:
        """The Secret's "password", or None when it has none."""
        if self._core is None:
            return None
        exceptions: Any = importlib.import_module("kubernetes.aio.client.exceptions")
        try:
            secret = await self._core.read_namespaced_secret(name, self.secrets_namespace)
        except exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise Unavailable(f"reading Secret {name}: {exc.status} {exc.reason}") from exc
        except OSError as exc:
            raise Unavailable(f"reading Secret {name}: {exc}") from exc
        data = secret.data or {}
        if "password" not in data:
            return None
        try:
            return base64.b64decode(data["password"], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None

    async def _sync(self, key: str) -> None:
        obj = self.objects.get(key)
        try:
            if obj is not None:
                secrets: dict[str, str] = {}
                for ref in sorted(secret_refs(obj)):
                    found = await self._password(ref)
                    if found is not None:
                        secrets[ref] = found
                policy = build_policy(raw_from_cilium(obj, source=SOURCE, secrets=secrets))
                await self.store.put(policy)
                return
        except InvalidArgument as exc:
            log.warning(
                "CiliumBGPPeeringPolicy refused, its policy removed",
                extra={"policy": key, "reason": exc.details},
            )
        except FailedPrecondition as exc:  # the API's policy of that name
            log.warning(
                "CiliumBGPPeeringPolicy skipped", extra={"policy": key, "reason": exc.details}
            )
            return
        with contextlib.suppress(FailedPrecondition):  # the API's: not ours to delete
            await self.store.delete(key.partition("/")[2], SOURCE)
