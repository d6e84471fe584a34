"""Pure logic of flagella.datapath.bpf: policy expansion, port prefixes,
key encodings, the Maglev hash, the packet builder's checksums."""

from __future__ import annotations

import ctypes
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import packets as P
from flagella.datapath.bpf.policy import (
    PolicyEntry,
    expand,
    policy_key,
    policy_key_bytes,
    policy_value_bytes,
    port_prefixes,
)

EG = L.Direction.EGRESS
IN = L.Direction.INGRESS


@given(st.integers(0, 65535), st.integers(0, 65535))
def test_port_prefixes_cover_the_range_exactly(a: int, b: int) -> None:
    lo, hi = min(a, b), max(a, b)
    covered = []
    for base, bits in port_prefixes(lo, hi):
        size = 1 << (16 - bits)
        assert base % size == 0, "aligned"
        covered.append((base, base + size - 1))
    assert covered[0][0] == lo
    assert covered[-1][1] == hi
    for (_, end), (start, _) in itertools.pairwise(covered):
        assert start == end + 1
    assert len(covered) <= 30


def test_expand_single_port_proto_and_l3() -> None:
    keys = expand(
        [
            PolicyEntry(7, EG),
            PolicyEntry(8, EG, protocol=17),
            PolicyEntry(9, IN, protocol=6, port=443),
        ]
    )
    assert keys == {
        (7, 2, 0, 0, 104): (1, 0),
        (8, 2, 17, 0, 112): (1, 0),
        (9, 1, 6, 443, 128): (1, 0),
        (9, 1, 0, 0, 104): (L.Verdict.L4_ONLY, 0),
        (8, 2, 0, 0, 104): (L.Verdict.L4_ONLY, 0),
    }


def test_expand_any_protocol_with_port_is_tcp_udp_sctp() -> None:
    keys = expand([PolicyEntry(0, IN, port=53)])
    assert {k[2] for k in keys if k[4] == 128} == {6, 17, 132}


def test_deny_removes_covered_allows_but_not_others() -> None:
    keys = expand(
        [
            PolicyEntry(5, IN, L.Verdict.DENY, protocol=6, port=1024, end_port=2047),
            PolicyEntry(5, IN, protocol=6, port=1500),  # inside the deny: removed
            PolicyEntry(5, IN, protocol=6, port=80),  # outside: kept
            PolicyEntry(5, IN, protocol=6, port=1024, end_port=2047),  # same key: deny wins
        ]
    )
    assert keys[(5, 1, 6, 1024, 118)] == (L.Verdict.DENY, 0)
    assert (5, 1, 6, 1500, 128) not in keys
    assert keys[(5, 1, 6, 80, 128)] == (L.Verdict.ALLOW, 0)
    assert keys[(5, 1, 0, 0, 104)] == (L.Verdict.L4_ONLY, 0)


def test_only_denies_leave_no_l4_marker() -> None:
    keys = expand([PolicyEntry(5, IN, L.Verdict.DENY, protocol=6, port=22)])
    assert keys == {(5, 1, 6, 22, 128): (L.Verdict.DENY, 0)}


def test_invalid_entries_are_rejected() -> None:
    with pytest.raises(ValueError, match="end_port"):
        expand([PolicyEntry(1, IN, port=90, end_port=80)])
    with pytest.raises(ValueError, match="direction"):
        expand([PolicyEntry(1, L.Direction.UNSPECIFIED)])


def test_policy_key_bytes_put_the_port_in_network_order() -> None:
    k = policy_key(3, (9, 1, 6, 0x1234, 128))
    raw = bytes(k)
    assert ctypes.sizeof(k) == 24
    assert raw[4:8] == (9).to_bytes(4, "little")
    assert raw[16:20] == bytes([1, 6, 0x12, 0x34])
    assert L.decode_policy_key(k)["port"] == str(0x1234)


def test_prefix_encodings_round_trip() -> None:
    for cidr in ("10.0.0.0/8", "10.1.2.3/32", "0.0.0.0/0", "fd00::/64", "::/0"):
        fam, raw, bits = L.prefix_bits(cidr)
        assert L.prefix_of(fam, raw, bits) == cidr
    assert L.bytes_ip(L.ip_bytes("10.1.2.3")) == "10.1.2.3"
    assert L.bytes_ip(L.ip_bytes("fd00::1")) == "fd00::1"


def test_layout_version_changes_with_sizes() -> None:
    a = L.layout_version(L.MapSizes())
    assert a.startswith(f"v{L.LAYOUT_VERSION}-")
    assert a == L.layout_version(L.MapSizes())
    assert a != L.layout_version(L.MapSizes(ct=1024))
    # The per-endpoint budget is not a layout property.
    assert a == L.layout_version(L.MapSizes(policy_per_endpoint=10))


def test_maglev_hash_is_stable() -> None:
    # Pinned value: the C implementation must keep computing the same.
    h = L.maglev_hash("10.1.0.1", "10.96.0.10", 46000, 80, 6)
    assert h == 2252271230
    assert h != L.maglev_hash("10.1.0.1", "10.96.0.10", 46001, 80, 6)
    assert 0 <= L.maglev_slot("10.1.0.1", "10.96.0.10", 1, 2, 17, size=251) < 251


@pytest.mark.parametrize(
    ("proto", "src", "dst"),
    [
        (6, "10.0.0.1", "10.0.0.2"),
        (17, "10.0.0.1", "10.0.0.2"),
        (1, "10.0.0.1", "10.0.0.2"),
        (6, "fd00::1", "fd00::2"),
        (17, "fd00::1", "fd00::2"),
        (58, "fd00::1", "fd00::2"),
    ],
)
def test_packet_builder_checksums(proto: int, src: str, dst: str) -> None:
    pkt = P.parse(P.build(src, dst, proto=proto, payload=b"abc"))
    assert (pkt.src, pkt.dst, pkt.proto) == (src, dst, proto)
    assert pkt.l3_csum_ok
    assert pkt.l4_csum_ok
    bad = bytearray(P.build(src, dst, proto=proto, payload=b"abc"))
    bad[-1] ^= 0xFF
    assert not P.parse(bytes(bad)).l4_csum_ok


@given(
    st.integers(0, 0xFFFFFFFF),
    st.integers(0, 0xFFFF),
    st.sampled_from([0, 1]),
    st.sampled_from([0, 6, 17, 132]),
    st.integers(0, 65535),
    st.integers(0, 64),
    st.sampled_from(list(L.Verdict)),
    st.integers(0, 0xFFFFFFFF),
)
def test_packed_policy_entries_are_the_ctypes_ones(
    ident: int, ep: int, d: int, proto: int, base: int, plen: int, verdict: int, cookie: int
) -> None:
    """Policy._write packs keys and values with struct: byte for byte what
    the ctypes layout (the C side's) holds."""
    key = (ident, d, proto, base, plen)
    assert ctypes.sizeof(L.PolicyKey) == len(policy_key_bytes(ep, key))
    assert bytes(policy_key(ep, key)) == policy_key_bytes(ep, key)
    value = L.PolicyValue(verdict=verdict, cookie=cookie)
    assert bytes(value) == policy_value_bytes(verdict, cookie)
