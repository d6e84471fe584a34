"""The entry point for policy documents: YAML or JSON text holding one or
more FlagellaNetworkPolicy, CiliumNetworkPolicy,
CiliumClusterwideNetworkPolicy, Kubernetes NetworkPolicy,
AdminNetworkPolicy or BaselineAdminNetworkPolicy objects (several
YAML documents, a List, or a top-level list), read by a strict loader."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import yaml

from flagella.common.errors import InvalidArgument
from flagella.policy.rules.admin import API_VERSION as ADMIN_API
from flagella.policy.rules.admin import parse_admin_network_policy
from flagella.policy.rules.fields import Doc
from flagella.policy.rules.flagella_policy import parse_flagella_policy
from flagella.policy.rules.k8s import parse_k8s_network_policy
from flagella.policy.rules.model import Rule
from flagella.policy.rules.validate import check_unique, fail, join

_Parser = Callable[[Mapping[str, Any], str, "list[str] | None"], Rule]
_KINDS: dict[tuple[str, str], _Parser] = {
    ("flagella.io/v1", "FlagellaNetworkPolicy"): lambda o, p, w: parse_flagella_policy(
        o, p, warnings=w
    ),
    ("cilium.io/v2", "CiliumNetworkPolicy"): lambda o, p, w: parse_flagella_policy(
        o, p, warnings=w
    ),
    ("cilium.io/v2", "CiliumClusterwideNetworkPolicy"): lambda o, p, w: parse_flagella_policy(
        o, p, cluster_wide=True, warnings=w
    ),
    ("networking.k8s.io/v1", "NetworkPolicy"): lambda o, p, w: parse_k8s_network_policy(
        o, p, warnings=w
    ),
    (ADMIN_API, "AdminNetworkPolicy"): lambda o, p, w: parse_admin_network_policy(o, p),
    (ADMIN_API, "BaselineAdminNetworkPolicy"): lambda o, p, w: parse_admin_network_policy(
        o, p, baseline=True
    ),
}


def _object(value: Any, path: str, out: list[tuple[str, Rule]], warnings: list[str] | None) -> None:
    obj = Doc.mapping(value, path)
    kind = obj.get("kind")
    if kind == "List" or (isinstance(kind, str) and kind.endswith("List") and "items" in obj):
        for i, item in enumerate(Doc.seq(obj.get("items"), join(path, "items"))):
            _object(item, f"{join(path, 'items')}[{i}]", out, warnings)
        return
    out.append((path, parse_object(obj, path, warnings=warnings)))


def parse_object(
    obj: Mapping[str, Any], path: str = "", *, warnings: list[str] | None = None
) -> Rule:
    """The rule of one policy object (by its apiVersion and kind): what
    `flagella policy import` makes of it, and the Kubernetes watchers too.
    Raises InvalidArgument naming the path of the first problem; appends
    to warnings what was accepted but changed (a CIDR's host bits)."""
    kind = obj.get("kind")
    api = obj.get("apiVersion")
    parser = _KINDS.get((api, kind)) if isinstance(api, str) and isinstance(kind, str) else None
    if parser is None:
        where = join(path, "kind") if "kind" in obj else join(path, "apiVersion")
        raise fail(
            where,
            f"apiVersion {api!r} kind {kind!r} is neither a FlagellaNetworkPolicy "
            "(flagella.io/v1) nor a Kubernetes NetworkPolicy (networking.k8s.io/v1) "
            f"nor an (Baseline)AdminNetworkPolicy ({ADMIN_API})",
        )
    return parser(obj, path, warnings)


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_BaseLoader):  # type: ignore[misc]
    """Safe YAML that refuses a key given twice in one mapping (PyYAML would
    silently keep the last one, e.g. of two policies pasted together)."""


def _strict_mapping(loader: Any, node: Any, deep: bool = False) -> Any:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


def parse_document(text: str, *, warnings: list[str] | None = None) -> list[Rule]:
    """Every rule in a YAML or JSON document (several YAML documents, a
    List, or a top-level list of objects). Validates everything; raises
    InvalidArgument naming the path of the first problem; appends to
    warnings ("<path>: <what>") what was accepted but changed."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidArgument(
            f"not valid YAML or JSON{where}: {problem}", field="document"
        ) from None
    if not docs:
        raise InvalidArgument("no policy in the document", field="document")
    found: list[tuple[str, Rule]] = []
    for i, doc in enumerate(docs):
        prefix = f"[{i}]" if len(docs) > 1 else ""
        if isinstance(doc, list):
            for j, item in enumerate(doc):
                _object(item, f"{prefix}[{j}]", found, warnings)
        else:
            _object(doc, prefix, found, warnings)
    check_unique(found)
    return [rule for _, rule in found]
