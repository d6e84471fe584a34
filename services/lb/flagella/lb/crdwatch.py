"""A cluster-wide custom resource (Cilium's CiliumBGPPeeringPolicy,
CiliumLocalRedirectPolicy, CiliumLoadBalancerIPPool) followed into the
lb's state, when the lb reads Kubernetes (--kubeconfig).

Every replica mirrors the objects into a table (a KubeSource); the replica
holding the lb's Lease (flagella.lb.k8s) writes them as records of source
"kubernetes": each term starts with every object, and deletes the
kubernetes records that have none any more; then each change. An object
the lb refuses is logged and its record removed (a record that no longer
says what its object says is not kept). The API can neither replace nor
delete these, and the watcher touches no record of the API's (one of the
same name is logged and left).

A watcher says what the objects are and converts one into its record
(_put), deletes one (_delete), and lists the keys of its stored records
of source kubernetes (_stored_keys)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from flagella.common.backoff import Backoff
from flagella.common.errors import FailedPrecondition, FlagellaError, InvalidArgument
from flagella.common.sync import KubeSource, Table
from flagella.common.sync.kube import Obj
from flagella.common.sync.table import LOCAL_LOG_SIZE

log = logging.getLogger(__name__)

SOURCE = "kubernetes"


class CustomResourceWatcher(ABC):
    GROUP: ClassVar[str]  # "cilium.io"
    VERSION: ClassVar[str]  # "v2alpha1"
    PLURAL: ClassVar[str]  # "ciliumbgppeeringpolicies"
    KIND: ClassVar[str]  # "CiliumBGPPeeringPolicy"
    # What a record is, in logs: "policy" (its key under LOG_KEY), and
    # many of them: "BGP peering policies".
    NOUN: ClassVar[str]
    NOUNS: ClassVar[str]
    LOG_KEY: ClassVar[str]

    def __init__(self, table: str, *, watch_timeout: int = 60) -> None:
        self.watch_timeout = watch_timeout
        # Every object by its key ("<namespace>/<name>", "/<name>" when
        # cluster-scoped).
        self.objects: Table[str, Obj] = Table(table, log_size=LOCAL_LOG_SIZE)
        self.backoff = Backoff(1.0, 30.0)
        self._custom: Any = None

    def source(self, api: Any) -> KubeSource[Obj]:
        """The list/watch of every object (of every namespace) into
        self.objects."""
        client: Any = importlib.import_module("kubernetes.aio.client")
        custom = self._custom = client.CustomObjectsApi(api)
        return KubeSource(
            self.PLURAL,
            functools.partial(
                custom.list_cluster_custom_object_without_preload_content,
                self.GROUP,
                self.VERSION,
                self.PLURAL,
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
                        keys |= await self._stored_keys()
                    for key in sorted(keys):
                        await self._sync(key)
                    await self._synced()
                    self.backoff.reset()
            except FlagellaError as exc:
                log.warning(
                    f"{self.NOUNS} from kubernetes not synced, will retry",
                    extra={"reason": exc.details},
                )
                await self.backoff.wait()

    async def _sync(self, key: str) -> None:
        """One object's record: written, or removed (no object, or one
        refused)."""
        obj = self.objects.get(key)
        try:
            if obj is not None:
                await self._put(obj)
                return
        except InvalidArgument as exc:
            self._refused(key, exc.details)
            log.warning(
                f"{self.KIND} refused, its {self.NOUN} removed",
                extra={self.LOG_KEY: key, "reason": exc.details},
            )
        except FailedPrecondition as exc:  # the API's record of that name
            self._refused(key, exc.details)
            log.warning(f"{self.KIND} skipped", extra={self.LOG_KEY: key, "reason": exc.details})
            return
        with contextlib.suppress(FailedPrecondition):  # the API's: not ours to delete
            await self._delete(key)

    @abstractmethod
    async def _stored_keys(self) -> set[str]:
        """The object keys of the stored records of source kubernetes."""

    @abstractmethod
    async def _put(self, obj: Obj) -> None:
        """Store the object's record (InvalidArgument: the object refused;
        FailedPrecondition: the API's record of that name)."""

    @abstractmethod
    async def _delete(self, key: str) -> None:
        """Delete the record of that object key (of source kubernetes)."""

    # Optional hooks (LB-IPAM pools write each object's status).

    def _refused(self, key: str, reason: str) -> None:  # noqa: B027
        """The object was refused or skipped, for reason."""

    async def _synced(self) -> None:  # noqa: B027
        """After each batch of objects synced."""
