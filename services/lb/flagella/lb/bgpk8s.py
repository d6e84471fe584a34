"""CiliumBGPPeeringPolicy objects (cilium.io/v2alpha1) into BGP peering
policies of source "kubernetes", when the lb reads Kubernetes
(--kubeconfig): followed as crdwatch.py says (written by the replica
holding the lb's Lease; an object the lb refuses is logged and its policy
removed, as a peering that no longer says what its object says is not
kept; the API's policies are never touched). A neighbour's authSecretRef
names a Secret of --bgp-secrets-namespace whose key "password" is read
when its object is synced.
"""

from __future__ import annotations

import base64
import binascii
import importlib
from typing import Any

from flagella.common.errors import Unavailable
from flagella.common.sync import KubeSource
from flagella.common.sync.kube import Obj
from flagella.lb.bgp import build_policy, raw_from_cilium, secret_refs
from flagella.lb.bgpstore import BgpPolicyStore
from flagella.lb.crdwatch import SOURCE, CustomResourceWatcher


class BgpKubeWatcher(CustomResourceWatcher):
    GROUP, VERSION, PLURAL = "cilium.io", "v2alpha1", "ciliumbgppeeringpolicies"
    KIND = "CiliumBGPPeeringPolicy"
    NOUN, NOUNS, LOG_KEY = "policy", "BGP peering policies", "policy"

    def __init__(
        self, store: BgpPolicyStore, secrets_namespace: str, *, watch_timeout: int = 60
    ) -> None:
        super().__init__("k8s-bgp-policies", watch_timeout=watch_timeout)
        self.store = store
        self.secrets_namespace = secrets_namespace
        self._core: Any = None

    def source(self, api: Any) -> KubeSource[Obj]:
        """The list/watch of every object, and the client its Secrets are
        read with."""
        client: Any = importlib.import_module("kubernetes.aio.client")
        self._core = client.CoreV1Api(api)
        return super().source(api)

    async def _stored_keys(self) -> set[str]:
        stored, _ = await self.store.list()
        # Cluster-scoped: the objects' keys are "/<name>".
        return {f"/{p.name}" for p in stored if p.source == SOURCE}

    async def _put(self, obj: Obj) -> None:
        secrets: dict[str, str] = {}
        for ref in sorted(secret_refs(obj)):
            found = await self._password(ref)
            if found is not None:
                secrets[ref] = found
        await self.store.put(build_policy(raw_from_cilium(obj, source=SOURCE, secrets=secrets)))

    async def _delete(self, key: str) -> None:
        await self.store.delete(key.partition("/")[2], SOURCE)

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
