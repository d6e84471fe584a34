"""flagella.cni.hpack: the RFC 7541 examples, differential fuzzing against
the hpack library (an independent implementation) across whole sequences of
header blocks sharing one dynamic table, and garbage in: only HpackError
comes out."""

from __future__ import annotations

import contextlib

import hpack as ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flagella.cni import hpack

# RFC 7541 C.4: requests with Huffman coding, one connection.
C4 = [
    (
        "828684418cf1e3c2e5f23a6ba0ab90f4ff",
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
         (b":authority", b"www.example.com")],
    ),
    (
        "828684be5886a8eb10649cbf",
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
         (b":authority", b"www.example.com"), (b"cache-control", b"no-cache")],
    ),
    (
        "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
        [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/index.html"),
         (b":authority", b"www.example.com"), (b"custom-key", b"custom-value")],
    ),
]  # fmt: skip

# RFC 7541 C.5: responses without Huffman, a 256-byte table: evictions.
C5 = [
    (
        "4803333032580770726976617465611d4d6f6e2c203231204f637420323031332032303a31333a"
        "323120474d546e1768747470733a2f2f7777772e6578616d706c652e636f6d",
        [(b":status", b"302"), (b"cache-control", b"private"),
         (b"date", b"Mon, 21 Oct 2013 20:13:21 GMT"), (b"location", b"https://www.example.com")],
    ),
    (
        "4803333037c1c0bf",
        [(b":status", b"307"), (b"cache-control", b"private"),
         (b"date", b"Mon, 21 Oct 2013 20:13:21 GMT"), (b"location", b"https://www.example.com")],
    ),
    (
        "88c1611d4d6f6e2c203231204f637420323031332032303a31333a323220474d54c05a04677a6970"
        "7738666f6f3d4153444a4b48514b425a584f5157454f50495541585157454f49553b206d61782d61"
        "67653d333630303b2076657273696f6e3d31",
        [(b":status", b"200"), (b"cache-control", b"private"),
         (b"date", b"Mon, 21 Oct 2013 20:13:22 GMT"), (b"location", b"https://www.example.com"),
         (b"content-encoding", b"gzip"),
         (b"set-cookie", b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1")],
    ),
]  # fmt: skip


def test_rfc7541_c4_requests_with_huffman() -> None:
    decoder = hpack.Decoder()
    for raw, headers in C4:
        assert decoder.decode(bytes.fromhex(raw)) == headers


def test_rfc7541_c5_responses_with_evictions() -> None:
    decoder = hpack.Decoder(max_table_size=256)
    for raw, headers in C5:
        assert decoder.decode(bytes.fromhex(raw)) == headers
    # After C.5.3 the table holds exactly these three (RFC 7541 C.5.3).
    assert decoder.entries[::-1] == [
        (b"set-cookie", b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"),
        (b"content-encoding", b"gzip"),
        (b"date", b"Mon, 21 Oct 2013 20:13:22 GMT"),
    ]
    assert decoder.size == 215


def test_rfc7541_c1_integers() -> None:
    assert hpack.encode_int(10, 5) == bytes([0b01010])
    assert hpack.encode_int(1337, 5) == bytes([0b11111, 0b10011010, 0b00001010])
    assert hpack.encode_int(42, 8) == bytes([42])


names = st.one_of(
    st.sampled_from([n for n, _ in hpack.STATIC_TABLE]),
    st.binary(min_size=1, max_size=40).map(lambda b: b.lower()),
)
values = st.one_of(st.binary(max_size=300), st.text(max_size=100).map(str.encode))
header_lists = st.lists(st.tuples(names, values), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(header_lists, st.booleans(), st.one_of(st.none(), st.integers(0, 4096))),
        min_size=1,
        max_size=6,
    )
)
def test_decodes_what_the_hpack_library_encodes(
    blocks: list[tuple[list[tuple[bytes, bytes]], bool, int | None]],
) -> None:
    """One encoder and one decoder across several blocks: the dynamic
    table, its size updates and evictions must agree."""
    encoder = ref.Encoder()
    decoder = hpack.Decoder()
    for headers, huffman, table_size in blocks:
        if table_size is not None:
            encoder.header_table_size = table_size  # a size update opens the next block
        block = encoder.encode(headers, huffman=huffman)
        assert decoder.decode(block) == headers


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(header_lists, min_size=1, max_size=4))
def test_never_indexed_and_unindexed_literals(blocks: list[list[tuple[bytes, bytes]]]) -> None:
    encoder = ref.Encoder()
    decoder = hpack.Decoder()
    for headers in blocks:
        # hpack's NeverIndexedHeaderTuple and sensitive flag: 0001 literals.
        sensitive = [ref.NeverIndexedHeaderTuple(n, v) for n, v in headers]
        assert decoder.decode(encoder.encode(sensitive)) == headers


@settings(max_examples=300, deadline=None)
@given(headers=header_lists)
def test_the_hpack_library_decodes_our_encoding(headers: list[tuple[bytes, bytes]]) -> None:
    got = ref.Decoder().decode(hpack.encode(headers), raw=True)
    assert [(bytes(n), bytes(v)) for n, v in got] == headers


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=400))
def test_huffman_agrees_with_the_hpack_library(data: bytes) -> None:
    encoded = ref.huffman.HuffmanEncoder(
        ref.huffman_constants.REQUEST_CODES, ref.huffman_constants.REQUEST_CODES_LENGTH
    ).encode(data)
    assert hpack.huffman_encode(data) == encoded
    assert hpack.huffman_decode(encoded) == data


@settings(max_examples=2000, deadline=None)
@given(block=st.binary(max_size=200))
def test_garbage_is_an_hpack_error_and_nothing_else(block: bytes) -> None:
    with contextlib.suppress(hpack.HpackError):
        hpack.Decoder().decode(block)


@settings(max_examples=1000, deadline=None)
@given(data=st.binary(max_size=60))
def test_garbage_huffman_is_an_hpack_error_or_agrees(data: bytes) -> None:
    try:
        ours: bytes | None = hpack.huffman_decode(data)
    except hpack.HpackError:
        ours = None
    try:
        theirs: bytes | None = ref.huffman_table.decode_huffman(data)
    except ref.HPACKDecodingError:
        theirs = None
    assert ours == theirs


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (b"\x80", "index 0"),
        (b"\xbe", "beyond"),  # dynamic index 62 with an empty table
        (b"\x3f\xe2\x1f", "over"),  # size update to 4097
        (b"\x82\x20", "after a header"),
        (b"\x00\x81\xff", "padding"),  # Huffman string of one byte 0xff: padding > 7 bits
        (b"\x00\x84\xff\xff\xff\xff", "EOS"),  # 30 ones: the EOS symbol
        (b"\x00\x05ab", "truncated"),
        (b"\x7f", "truncated"),
        (b"\x7f\xff\xff\xff\xff\xff\xff", "truncated|too large"),
    ],
)
def test_bad_blocks(block: bytes, why: str) -> None:
    with pytest.raises(hpack.HpackError, match=why):
        hpack.Decoder().decode(block)


def test_size_update_to_zero_empties_the_table() -> None:
    decoder = hpack.Decoder()
    decoder.decode(b"\x40\x01a\x01b")  # a: b, indexed
    assert decoder.decode(b"\xbe") == [(b"a", b"b")]
    decoder.decode(b"\x20")
    assert decoder.entries == []
    with pytest.raises(hpack.HpackError):
        decoder.decode(b"\xbe")


def test_an_entry_larger_than_the_table_empties_it() -> None:
    decoder = hpack.Decoder(max_table_size=40)
    decoder.decode(b"\x40\x01a\x01b")
    assert decoder.size == 34
    decoder.decode(b"\x40\x01c\x0a" + b"x" * 10)  # 43 bytes: evicts all, is not added
    assert (decoder.entries, decoder.size) == ([], 0)
