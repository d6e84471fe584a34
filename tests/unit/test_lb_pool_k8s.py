"""CiliumLoadBalancerIPPool objects to LB-IPAM pools (pure part): fields
read, errors naming the object's field, the conflict condition."""

from __future__ import annotations

from typing import Any

import pytest

from flagella.common.errors import InvalidArgument
from flagella.lb.lbipam import SOURCE_KUBERNETES
from flagella.lb.lbpoolk8s import conflict_condition, pool_from_object
from flagella.lb.selector import Requirement


def obj(spec: dict[str, Any], name: str = "blue") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": spec,
    }


def test_pool_from_object() -> None:
    pool = pool_from_object(
        obj(
            {
                "blocks": [
                    {"cidr": "198.51.100.0/30"},
                    {"start": "2001:db8::1", "stop": "2001:db8::4"},
                ],
                "serviceSelector": {
                    "matchLabels": {"app": "web"},
                    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["b", "a"]}],
                },
                "disabled": True,
            }
        )
    )
    assert (pool.name, pool.size, pool.disabled, pool.source) == (
        "blue",
        8,
        True,
        SOURCE_KUBERNETES,
    )
    assert pool.selector == (("app", "web"),)
    assert pool.expressions == (Requirement("tier", "In", ("a", "b")),)
    assert pool.created == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"blocks": [{"cidr": "198.51.100.1/30"}]}, "spec.blocks[0].cidr"),
        ({"blocks": [{"cidr": "198.51.100.0/30", "start": "198.51.100.1"}]}, "spec.blocks[0]"),
        ({"blocks": []}, "spec.blocks"),
        ({"blocks": "x"}, "spec.blocks"),
        (
            {
                "blocks": [{"cidr": "198.51.100.0/30"}],
                "serviceSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]},
            },
            "spec.serviceSelector.matchExpressions[0].operator",
        ),
        (
            {
                "blocks": [{"cidr": "198.51.100.0/30"}],
                "serviceSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]},
            },
            "spec.serviceSelector.matchExpressions[0].values",
        ),
        (
            {
                "blocks": [{"cidr": "198.51.100.0/30"}],
                "serviceSelector": {
                    "matchExpressions": [{"key": "a", "operator": "In", "values": ["b c"]}]
                },
            },
            "spec.serviceSelector.matchExpressions[0].values[0]",
        ),
        (
            {"blocks": [{"cidr": "198.51.100.0/30"}], "serviceSelector": ["app"]},
            "spec.serviceSelector",
        ),
        (
            {
                "blocks": [{"cidr": "198.51.100.0/30"}],
                "serviceSelector": {"matchLabels": {"a b": "c"}},
            },
            "spec.serviceSelector.matchLabels[a b]",
        ),
    ],
)
def test_bad_objects_name_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        pool_from_object(obj(spec))
    assert info.value.field == field


def test_conflict_condition() -> None:
    assert conflict_condition("", "")["status"] == "False"
    overlap = conflict_condition("198.51.100.0/30 overlaps pool 'x' (198.51.100.0/29)", "")
    assert (overlap["type"], overlap["status"], overlap["reason"]) == (
        "cilium.io/PoolConflict",
        "True",
        "cidr_overlap",
    )
    assert conflict_condition("", "spec.blocks: bad")["reason"] == "invalid"
