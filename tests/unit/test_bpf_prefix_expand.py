"""The prefix_policy writer's expansion: prefixes to LPM keys, ports to the
value's (protocol, range) list."""

from __future__ import annotations

import pytest

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.prefixpolicy import PrefixPortsExceeded, PrefixRule, expand

IN, OUT = L.Direction.INGRESS, L.Direction.EGRESS
V4 = bytes(10) + b"\xff\xff"


def test_keys_and_ports() -> None:
    out = expand(
        [
            PrefixRule("10.0.0.0/8", IN, ((6, 80, 0), (0, 443, 0), (17, 0, 0))),
            PrefixRule("fd00::/64", OUT, ((6, 8000, 8099),)),
            PrefixRule("10.1.0.0/16", IN, ()),
        ]
    )
    assert out == {
        (1, 4, V4 + bytes([10, 0, 0, 0]), 104): (
            (6, 80, 80),
            (6, 443, 443),
            (17, 0, 0xFFFF),
            (17, 443, 443),
            (132, 443, 443),
        ),
        (2, 6, bytes([0xFD]) + bytes(15), 64): ((6, 8000, 8099),),
        (1, 4, V4 + bytes([10, 1, 0, 0]), 112): (),
    }


def test_everything_absorbs_the_rest_and_duplicates_merge() -> None:
    out = expand(
        [
            PrefixRule("10.0.0.0/8", IN, ((6, 80, 0),)),
            PrefixRule("10.0.0.0/8", IN, ((0, 0, 0),)),
        ]
    )
    assert list(out.values()) == [((0, 0, 0xFFFF),)]


def test_limits_and_errors() -> None:
    many = tuple((6, 1000 + 2 * i, 0) for i in range(L.PREFIX_POLICY_PORTS + 1))
    with pytest.raises(PrefixPortsExceeded):
        expand([PrefixRule("10.0.0.0/8", IN, many)])
    with pytest.raises(ValueError, match="range"):
        expand([PrefixRule("10.0.0.0/8", IN, ((6, 90, 80),))])
    with pytest.raises(ValueError, match="direction"):
        expand([PrefixRule("10.0.0.0/8", L.Direction(0), ())])
