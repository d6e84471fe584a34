"""LB-IPAM's pure logic: pool validation (the field named), overlap, and
plan() (requested, kept, shared, exhausted, all families or none)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flagella.common.errors import InvalidArgument
from flagella.lb.lbipam import (
    NAMESPACE_LABEL,
    SOURCE_KUBERNETES,
    AddressUse,
    Assigned,
    Claimant,
    LbRequest,
    Pool,
    Unsatisfied,
    conflicts,
    overlap,
    plan,
    usable,
    validate_pool,
    validate_request,
)
from flagella.lb.selector import Requirement


def who(
    name: str, port: int = 80, key: str = "", families: tuple[int, ...] = (4,), ns: str = "a"
) -> Claimant:
    return Claimant(
        name, ns, {"app": name}, frozenset({("TCP", port)}), LbRequest((), key, families)
    )


def test_pool_validation_names_the_field() -> None:
    cases = [
        (("p", [("10.0.0.1/30", "", "")], {}), "pool.blocks[0].cidr"),
        (("p", [("", "10.0.0.9", "10.0.0.1")], {}), "pool.blocks[0]"),
        (("p", [("", "10.0.0.1", "fd00::1")], {}), "pool.blocks[0]"),
        (("p", [("10.0.0.0/30", "10.0.0.1", "10.0.0.2")], {}), "pool.blocks[0]"),
        (("p", [("10.0.0.0/30", "", ""), ("", "10.0.0.3", "10.0.0.9")], {}), "pool.blocks[1]"),
        (("p", [("224.0.0.0/30", "", "")], {}), "pool.blocks[0].cidr"),
        (("p", [], {}), "pool.blocks"),
        (("", [("10.0.0.0/30", "", "")], {}), "pool.name"),
        (("p", [("10.0.0.0/30", "", "")], {"no spaces": "x"}), "pool.service_selector[no spaces]"),
        (("p", [("10.0.0.0/30", "", "")], {"a/b/c": "x"}), "pool.service_selector[a/b/c]"),
        (("p", [("10.0.0.0/30", "", "")], {"app": "not a value"}), "pool.service_selector[app]"),
    ]
    for (name, blocks, sel), field in cases:
        with pytest.raises(InvalidArgument) as err:
            validate_pool(name, blocks, sel, False)
        assert err.value.field == field, (blocks, err.value)
    p = validate_pool("p", [("", "fd00::10", "fd00::1f"), ("10.0.0.0/30", "", "")], {}, False)
    assert p.size == 20
    q = validate_pool("q", [("10.0.0.3/32", "", "")], {}, False)
    assert overlap(q, [p]) is not None
    assert overlap(q, [q]) is None
    with pytest.raises(InvalidArgument) as err:
        validate_request(["fd00::1", "fd00::2"], "", [], 4)
    assert err.value.field == "service.load_balancer.requested_ips[1]"
    assert validate_request(["fd00::1"], "", [4], 4).families == (4, 6)


def test_plan() -> None:
    pools = [
        validate_pool(
            "v4", [("10.0.0.0/31", "", "")], {"io.kubernetes.service.namespace": "a"}, False
        ),
        validate_pool("v6", [("", "fd00::1", "fd00::1")], {}, False),
    ]
    # Lowest free; all families or none.
    assert plan(who("s1", families=(4, 6)), pools, {}) == Assigned(("10.0.0.0", "fd00::1"))
    used = {"10.0.0.0": AddressUse("", {"s1": frozenset({("TCP", 80)})})}
    assert plan(who("s2"), pools, used) == Assigned(("10.0.0.1",))
    both = {**used, "10.0.0.1": AddressUse("k", {"s2": frozenset({("TCP", 80)})})}
    out = plan(who("s3"), pools, both)
    assert isinstance(out, Unsatisfied)
    assert out.condition.reason == "pool_exhausted"
    # Same sharing key, other port: shares; same port: no.
    assert plan(who("s3", 443, "k"), pools, both) == Assigned(("10.0.0.1",))
    assert isinstance(plan(who("s3", 80, "k"), pools, both), Unsatisfied)
    # Kept while its pool holds it; namespace selector.
    assert plan(who("s1"), pools, {}, current=("10.0.0.1",)) == Assigned(("10.0.0.1",))
    out = plan(who("s4", ns="b"), pools, {})
    assert isinstance(out, Unsatisfied)
    assert out.condition.reason == "no_pool"
    req = Claimant("s5", "a", {}, frozenset({("TCP", 80)}), LbRequest(("10.0.0.0",), "", (4,)))
    out = plan(req, pools, used)
    assert isinstance(out, Unsatisfied)
    assert out.condition.reason == "already_allocated"
    assert "s1" in out.condition.message


def test_kubernetes_pools_overlapping_are_conflicting_and_not_used() -> None:
    """API pools never overlap (refused); a Kubernetes pool overlapping a pool
    taken before it (the API's, then older objects) is conflicting, and
    usable() leaves it out; the older one keeps its addresses."""
    api = validate_pool("api", [("10.0.0.0/30", "", "")], {}, False)
    old = replace(
        validate_pool("old", [("10.0.1.0/30", "", "")], {}, False),
        source=SOURCE_KUBERNETES,
        created="2026-01-01T00:00:00Z",
    )
    new = replace(
        validate_pool("new", [("", "10.0.1.2", "10.0.1.9")], {}, False),
        source=SOURCE_KUBERNETES,
        created="2026-02-01T00:00:00Z",
    )
    onto_api = replace(
        validate_pool("a-onto-api", [("10.0.0.2/31", "", "")], {}, False),
        source=SOURCE_KUBERNETES,
        created="2025-01-01T00:00:00Z",
    )
    bad = conflicts([new, api, old, onto_api])
    assert set(bad) == {"new", "a-onto-api"}
    assert bad["new"] == "10.0.1.2-10.0.1.9 overlaps pool 'old' (10.0.1.0/30)"
    assert [p.name for p in usable([new, api, old, onto_api])] == ["api", "old"]
    # Without the older one the newer is fine; a Kubernetes pool is never refused.
    assert conflicts([new, api]) == {}
    assert overlap(new, [old]) is None
    assert overlap(api, [old, replace(api, name="x")]) is not None


def test_pool_selector_expressions() -> None:
    pool = replace(
        validate_pool("p", [("10.0.0.0/30", "", "")], {"app": "web"}, False),
        expressions=(
            Requirement("tier", "NotIn", ("internal",)),
            Requirement("team", "Exists"),
            Requirement("legacy", "DoesNotExist"),
            Requirement(NAMESPACE_LABEL, "In", ("a", "b")),
        ),
    )
    assert pool.matches("a", {"app": "web", "team": "x"})
    assert pool.matches("b", {"app": "web", "team": "x", "tier": "edge"})
    assert not pool.matches("c", {"app": "web", "team": "x"})
    assert not pool.matches("a", {"app": "web", "team": "x", "tier": "internal"})
    assert not pool.matches("a", {"app": "web"})
    assert not pool.matches("a", {"app": "web", "team": "x", "legacy": ""})
    assert Pool.from_doc(pool.to_doc()) == pool
