"""CiliumLoadBalancerIPPool objects (cilium.io/v2alpha1) into LB-IPAM pools,
when the lb reads Kubernetes (--kubeconfig).

Every replica mirrors the objects into a table (a KubeSource); the replica
holding the lb's Lease (flagella.lb.k8s) writes them as pools of source
"kubernetes": each term starts with every object, and deletes the
kubernetes pools that have none any more; then each change. The API can
neither replace nor delete these pools, and the watcher touches no pool of
the API's (one of the same name is logged and left).

A pool overlapping another is not refused (the API server stored it
already): as Cilium does, it is marked conflicting (the condition
cilium.io/PoolConflict written to the object's status.conditions) and its
addresses are not used (lbipam.conflicts decides which: the API's pools and
older objects first). An object the lb cannot read (a bad CIDR) is logged,
its pool removed, and its status says why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flagella.common.backoff import Backoff
from flagella.common.errors import FailedPrecondition, FlagellaError, InvalidArgument
from flagella.common.sync import KubeSource, Table
from flagella.common.sync.kube import Obj
from flagella.lb.lbipam import SOURCE_KUBERNETES, Pool, validate_pool
from flagella.lb.lbipam_store import LbIpam
from flagella.lb.selector import build_selector, selector_from_doc

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "cilium.io", "v2alpha1", "ciliumloadbalancerippools"
CONFLICT_CONDITION = "cilium.io/PoolConflict"


def pool_from_object(obj: Obj) -> Pool:
    """A CiliumLoadBalancerIPPool as a pool of source kubernetes.
    InvalidArgument names the object's field (spec.blocks[0].cidr)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    blocks_doc = spec.get("blocks") or spec.get("cidrs") or []  # v1alpha2 called them cidrs
    if not isinstance(blocks_doc, list):
        raise InvalidArgument("not a list", field="spec.blocks")
    blocks: list[tuple[str, str, str]] = []
    for i, b in enumerate(blocks_doc):
        if not isinstance(b, Mapping):
            raise InvalidArgument("not an object", field=f"spec.blocks[{i}]")
        blocks.append(
            (str(b.get("cidr") or ""), str(b.get("start") or ""), str(b.get("stop") or ""))
        )
    raw_labels, raw_exprs = selector_from_doc(spec.get("serviceSelector"), "spec.serviceSelector")
    labels, expressions = build_selector(
        raw_labels,
        raw_exprs,
        "spec.serviceSelector",
        labels_field="matchLabels",
        exprs_field="matchExpressions",
    )
    try:
        pool = validate_pool(
            str(meta.get("name", "")), blocks, dict(labels), bool(spec.get("disabled", False))
        )
    except InvalidArgument as exc:
        # The request's field names, as the object's.
        field = (exc.field or "").replace("pool.blocks", "spec.blocks")
        field = field.replace("pool.name", "metadata.name")
        raise InvalidArgument(exc.message, field=field) from None
    return Pool(
        pool.name,
        pool.blocks,
        pool.selector,
        pool.disabled,
        expressions=expressions,
        source=SOURCE_KUBERNETES,
        created=str(meta.get("creationTimestamp") or ""),
    )


def conflict_condition(conflict: str, refused: str) -> dict[str, str]:
    """The cilium.io/PoolConflict condition of an object: True with why (an
    overlap, or the object refused), else False."""
    if refused:
        return {
            "type": CONFLICT_CONDITION,
            "status": "True",
            "reason": "invalid",
            "message": refused,
        }
    if conflict:
        return {
            "type": CONFLICT_CONDITION,
            "status": "True",
            "reason": "cidr_overlap",
            "message": conflict,
        }
    return {"type": CONFLICT_CONDITION, "status": "False", "reason": "no_conflict", "message": ""}


class PoolKubeWatcher:
    def __init__(self, ipam: LbIpam, *, watch_timeout: int = 60) -> None:
        self.ipam = ipam
        self.watch_timeout = watch_timeout
        self.objects: Table[str, Obj] = Table("k8s-lbippools")
        self.backoff = Backoff(1.0, 30.0)
        self._custom: Any = None
        # Why each object was refused (its status says so).
        self._refused: dict[str, str] = {}

    def source(self, api: Any) -> KubeSource[Obj]:
        """The list/watch of the (cluster-scoped) objects into self.objects."""
        client: Any = importlib.import_module("kubernetes.aio.client")
        custom = self._custom = client.CustomObjectsApi(api)
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
        objects into LB-IPAM, then their status; again from a full sync
        after any failure."""
        while True:
            try:
                async for batch in self.objects.subscribe():
                    keys = {c.key for c in batch.changes}
                    if batch.snapshot:
                        listed = await self.ipam.list_pools()
                        keys |= {
                            f"/{p.pool.name}" for p in listed if p.pool.source == SOURCE_KUBERNETES
                        }
                    for key in sorted(keys):
                        await self._sync(key)
                    await self._write_statuses()
                    self.backoff.reset()
            except FlagellaError as exc:
                log.warning(
                    "LB-IPAM pools from kubernetes not synced, will retry",
                    extra={"reason": exc.details},
                )
                await self.backoff.wait()

    async def _sync(self, key: str) -> None:
        """One object's pool (key "/<name>": cluster-scoped)."""
        name = key.rpartition("/")[2]
        obj = self.objects.get(key)
        self._refused.pop(name, None)
        try:
            if obj is not None:
                await self.ipam.upsert_pool(pool_from_object(obj))
                return
        except InvalidArgument as exc:
            self._refused[name] = exc.details
            log.warning(
                "CiliumLoadBalancerIPPool refused, its pool removed",
                extra={"pool": key, "reason": exc.details},
            )
        except FailedPrecondition as exc:  # the API's pool of that name
            self._refused[name] = exc.details
            log.warning(
                "CiliumLoadBalancerIPPool skipped", extra={"pool": key, "reason": exc.details}
            )
            return
        with contextlib.suppress(FailedPrecondition):  # the API's: not ours to delete
            await self.ipam.delete_pool(name, SOURCE_KUBERNETES)

    async def _write_statuses(self) -> None:
        """Each object's cilium.io/PoolConflict condition, where it differs
        from what the object says."""
        conflicts = {p.pool.name: p.conflict for p in await self.ipam.list_pools()}
        for key, obj in sorted(self.objects.items()):
            name = key.rpartition("/")[2]
            want = conflict_condition(conflicts.get(name, ""), self._refused.get(name, ""))
            await self._write_status(name, obj, want)

    async def _write_status(self, name: str, obj: Obj, want: Mapping[str, str]) -> None:
        conditions: Sequence[Any] = (obj.get("status") or {}).get("conditions") or []
        old = next(
            (c for c in conditions if isinstance(c, dict) and c.get("type") == CONFLICT_CONDITION),
            None,
        )
        if old is not None and all(old.get(k) == v for k, v in want.items()):
            return
        stamp = (
            old.get("lastTransitionTime")
            if old is not None and old.get("status") == want["status"]
            else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        )
        others = [
            c for c in conditions if isinstance(c, dict) and c.get("type") != CONFLICT_CONDITION
        ]
        body = {"status": {"conditions": [*others, {**want, "lastTransitionTime": stamp}]}}
        try:
            await self._custom.patch_cluster_custom_object_status(
                GROUP,
                VERSION,
                PLURAL,
                name,
                body,
                _content_type="application/merge-patch+json",
                _request_timeout=10,
            )
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return
            # Written again at the next change of any pool object.
            log.warning(
                "CiliumLoadBalancerIPPool status not written",
                extra={"pool": name, "reason": str(exc)[:200]},
            )
