"""Kubernetes label selectors as the lb's resources take them (a BGP
policy's node and service selectors, a local redirect policy's endpoint
selector, an LB-IPAM pool's service selector): the requirement type, its
validation (every error names the field by the path its caller gives),
and the reading of Cilium's matchLabels/matchExpressions documents."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flagella.common.errors import InvalidArgument
from flagella.lb.ciliumdoc import doc_list, doc_object
from flagella.lb.validation import LABEL_KEY_RE, LABEL_VALUE_RE, MAX_LABELS

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
MAX_VALUES = 64

Labels = tuple[tuple[str, str], ...]
# A matchExpressions entry as given: (key, operator, values).
RawRequirement = tuple[str, str, Sequence[str]]


@dataclass(frozen=True, slots=True)
class Requirement:
    """A matchExpressions requirement (In, NotIn, Exists, DoesNotExist)."""

    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, have: str | None) -> bool:
        """Whether a label of that value (None: absent) meets it."""
        if self.operator == "In":
            return have is not None and have in self.values
        if self.operator == "NotIn":
            return have is None or have not in self.values
        if self.operator == "Exists":
            return have is not None
        return have is None  # DoesNotExist


def build_selector(
    labels: Mapping[str, str],
    exprs: Sequence[RawRequirement],
    path: str,
    *,
    required: bool = False,
    labels_field: str = "match_labels",
    exprs_field: str = "match_expressions",
) -> tuple[Labels, tuple[Requirement, ...]]:
    """Validate a selector into its canonical form (labels sorted, each
    requirement's values sorted and unique). Errors name the field under
    path (`<path>.<labels_field>[<key>]`, `<path>.<exprs_field>[<i>].key`).
    required: an empty selector (every object) is refused."""
    if required and not labels and not exprs:
        # An empty selector would take everything: say which.
        raise InvalidArgument(
            "a selector with at least one label or expression is required", field=path
        )
    if len(labels) + len(exprs) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels and expressions", field=path)
    for key, value in labels.items():
        if not LABEL_KEY_RE.match(key):
            raise InvalidArgument(
                f"{key!r} is not a label key", field=f"{path}.{labels_field}[{key}]"
            )
        if not LABEL_VALUE_RE.match(value):
            raise InvalidArgument(
                f"{value!r} is not a label value", field=f"{path}.{labels_field}[{key}]"
            )
    reqs: list[Requirement] = []
    for i, (key, op, values) in enumerate(exprs):
        at = f"{path}.{exprs_field}[{i}]"
        if not LABEL_KEY_RE.match(key):
            raise InvalidArgument(f"{key!r} is not a label key", field=f"{at}.key")
        if op not in OPERATORS:
            raise InvalidArgument(
                f"{op!r} is not an operator ({', '.join(OPERATORS)})", field=f"{at}.operator"
            )
        if op in ("In", "NotIn") and not values:
            raise InvalidArgument(f"{op} needs at least one value", field=f"{at}.values")
        if op in ("Exists", "DoesNotExist") and values:
            raise InvalidArgument(f"{op} takes no values", field=f"{at}.values")
        if len(values) > MAX_VALUES:
            raise InvalidArgument(f"at most {MAX_VALUES} values", field=f"{at}.values")
        for j, v in enumerate(values):
            if not LABEL_VALUE_RE.match(v):
                raise InvalidArgument(f"{v!r} is not a label value", field=f"{at}.values[{j}]")
        reqs.append(Requirement(key, op, tuple(sorted(set(values)))))
    return tuple(sorted(labels.items())), tuple(reqs)


def requirements_to_doc(reqs: Sequence[Requirement]) -> list[dict[str, Any]]:
    """Requirements in a record's JSON (etcd)."""
    return [{"key": r.key, "operator": r.operator, "values": list(r.values)} for r in reqs]


def requirements_from_doc(docs: Sequence[Mapping[str, Any]]) -> tuple[Requirement, ...]:
    return tuple(Requirement(r["key"], r["operator"], tuple(r.get("values", ()))) for r in docs)


# --- Cilium's documents ---


def selector_from_doc(value: Any, path: str) -> tuple[dict[str, str], list[RawRequirement]]:
    """A Kubernetes LabelSelector document (matchLabels, matchExpressions)
    as plain values, not yet validated (build_selector); its structure's
    errors name the field by the document's path."""
    doc = doc_object(value, path)
    labels = doc_object(doc.get("matchLabels"), f"{path}.matchLabels")
    exprs: list[RawRequirement] = []
    exprs_path = f"{path}.matchExpressions"
    for i, item in enumerate(doc_list(doc.get("matchExpressions"), exprs_path)):
        e = doc_object(item, f"{exprs_path}[{i}]")
        values = doc_list(e.get("values"), f"{exprs_path}[{i}].values")
        exprs.append((str(e.get("key", "")), str(e.get("operator", "")), [str(v) for v in values]))
    return {str(k): str(v) for k, v in labels.items()}, exprs
