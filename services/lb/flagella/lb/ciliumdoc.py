"""Reading Cilium's documents (a CiliumBGPPeeringPolicy, a
CiliumLocalRedirectPolicy, as YAML or JSON decodes them) into plain
values: their structure's errors name the field by the document's path
("document.spec.virtualRouters[0]")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flagella.common.errors import InvalidArgument


def doc_object(value: Any, path: str) -> Mapping[str, Any]:
    """A document's object (absent: empty); InvalidArgument names path."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument("must be an object", field=path)
    return value


def doc_list(value: Any, path: str) -> list[Any]:
    """A document's list (absent: empty); InvalidArgument names path."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgument("must be a list", field=path)
    return value


def cilium_object(doc: Any, kind: str) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(metadata, spec) of an object that must be of kind."""
    doc = doc_object(doc, "document")
    if doc.get("kind") != kind:
        raise InvalidArgument(f"{doc.get('kind')!r} is not {kind}", field="document.kind")
    meta = doc_object(doc.get("metadata"), "document.metadata")
    return meta, doc_object(doc.get("spec"), "document.spec")
