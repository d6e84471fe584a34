"""LB-IPAM's pure logic: pool validation (the field named), overlap, and
plan() (requested, kept, shared, exhausted, all families or none)."""

from __future__ import annotations

import pytest

from flagella.common.errors import InvalidArgument
from flagella.lb.lbipam import (
    AddressUse,
    Assigned,
    Claimant,
    LbRequest,
    Unsatisfied,
    overlap,
    plan,
    validate_pool,
    validate_request,
)


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
