"""CiliumLoadBalancerIPPool objects (cilium.io/v2alpha1) into LB-IPAM pools
of source "kubernetes", when the lb reads Kubernetes (--kubeconfig):
followed as crdwatch.py says (written by the replica holding the lb's
Lease; the API's pools are never touched, one of the same name is logged
and left).

A pool overlapping another is not refused (the API server stored it
already): as Cilium does, it is marked conflicting (the condition
cilium.io/PoolConflict written to the object's status.conditions) and its
addresses are not used (lbipam.conflicts decides which: the API's pools and
older objects first). An object the lb cannot read (a bad CIDR) is logged,
its pool removed, and its status says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flagella.common.errors import InvalidArgument
from flagella.common.sync.kube import Obj
from flagella.lb.crdwatch import CustomResourceWatcher
from flagella.lb.lbipam import SOURCE_KUBERNETES, Pool, validate_pool
from flagella.lb.lbipam_store import LbIpam
from flagella.lb.selector import build_selector, selector_from_doc

log = logging.getLogger(__name__)

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


class PoolKubeWatcher(CustomResourceWatcher):
    """The objects into LB-IPAM, then their status."""

    GROUP, VERSION, PLURAL = "cilium.io", "v2alpha1", "ciliumloadbalancerippools"
    KIND = "CiliumLoadBalancerIPPool"
    NOUN, NOUNS, LOG_KEY = "pool", "LB-IPAM pools", "pool"

    def __init__(self, ipam: LbIpam, *, watch_timeout: int = 60) -> None:
        super().__init__("k8s-lbippools", watch_timeout=watch_timeout)
        self.ipam = ipam
        # Why each object was refused (its status says so).
        self._why: dict[str, str] = {}

    async def _stored_keys(self) -> set[str]:
        listed = await self.ipam.list_pools()
        # Cluster-scoped: the objects' keys are "/<name>".
        return {f"/{p.pool.name}" for p in listed if p.pool.source == SOURCE_KUBERNETES}

    async def _sync(self, key: str) -> None:
        self._why.pop(_name(key), None)
        await super()._sync(key)

    async def _put(self, obj: Obj) -> None:
        await self.ipam.upsert_pool(pool_from_object(obj))

    async def _delete(self, key: str) -> None:
        await self.ipam.delete_pool(_name(key), SOURCE_KUBERNETES)

    def _refused(self, key: str, reason: str) -> None:
        self._why[_name(key)] = reason

    async def _synced(self) -> None:
        await self._write_statuses()

    async def _write_statuses(self) -> None:
        """Each object's cilium.io/PoolConflict condition, where it differs
        from what the object says."""
        conflicts = {p.pool.name: p.conflict for p in await self.ipam.list_pools()}
        for key, obj in sorted(self.objects.items()):
            name = _name(key)
            want = conflict_condition(conflicts.get(name, ""), self._why.get(name, ""))
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
                self.GROUP,
                self.VERSION,
                self.PLURAL,
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


def _name(key: str) -> str:
    """An object's name from its key ("/<name>": cluster-scoped)."""
    return key.rpartition("/")[2]
