"""HPACK (RFC 7541) as flagella-cni's gRPC client needs it: an encoder that
writes every header as a literal without indexing (no Huffman, no dynamic
table: nothing for the peer to keep), and a full decoder for what a server
sends (indexed fields, literals of every kind, the dynamic table and its size
updates, Huffman-coded strings). Standard library only."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

# RFC 7541 Appendix A.
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
)

# RFC 7541 Appendix B: (code, bit length) of symbols 0..255 and EOS (256).
HUFFMAN_CODES: tuple[tuple[int, int], ...] = (
    (0x1FF8, 13),
    (0x7FFFD8, 23),
    (0xFFFFFE2, 28),
    (0xFFFFFE3, 28),
    (0xFFFFFE4, 28),
    (0xFFFFFE5, 28),
    (0xFFFFFE6, 28),
    (0xFFFFFE7, 28),
    (0xFFFFFE8, 28),
    (0xFFFFEA, 24),
    (0x3FFFFFFC, 30),
    (0xFFFFFE9, 28),
    (0xFFFFFEA, 28),
    (0x3FFFFFFD, 30),
    (0xFFFFFEB, 28),
    (0xFFFFFEC, 28),
    (0xFFFFFED, 28),
    (0xFFFFFEE, 28),
    (0xFFFFFEF, 28),
    (0xFFFFFF0, 28),
    (0xFFFFFF1, 28),
    (0xFFFFFF2, 28),
    (0x3FFFFFFE, 30),
    (0xFFFFFF3, 28),
    (0xFFFFFF4, 28),
    (0xFFFFFF5, 28),
    (0xFFFFFF6, 28),
    (0xFFFFFF7, 28),
    (0xFFFFFF8, 28),
    (0xFFFFFF9, 28),
    (0xFFFFFFA, 28),
    (0xFFFFFFB, 28),
    (0x14, 6),
    (0x3F8, 10),
    (0x3F9, 10),
    (0xFFA, 12),
    (0x1FF9, 13),
    (0x15, 6),
    (0xF8, 8),
    (0x7FA, 11),
    (0x3FA, 10),
    (0x3FB, 10),
    (0xF9, 8),
    (0x7FB, 11),
    (0xFA, 8),
    (0x16, 6),
    (0x17, 6),
    (0x18, 6),
    (0x0, 5),
    (0x1, 5),
    (0x2, 5),
    (0x19, 6),
    (0x1A, 6),
    (0x1B, 6),
    (0x1C, 6),
    (0x1D, 6),
    (0x1E, 6),
    (0x1F, 6),
    (0x5C, 7),
    (0xFB, 8),
    (0x7FFC, 15),
    (0x20, 6),
    (0xFFB, 12),
    (0x3FC, 10),
    (0x1FFA, 13),
    (0x21, 6),
    (0x5D, 7),
    (0x5E, 7),
    (0x5F, 7),
    (0x60, 7),
    (0x61, 7),
    (0x62, 7),
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),
    (0x66, 7),
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6A, 7),
    (0x6B, 7),
    (0x6C, 7),
    (0x6D, 7),
    (0x6E, 7),
    (0x6F, 7),
    (0x70, 7),
    (0x71, 7),
    (0x72, 7),
    (0xFC, 8),
    (0x73, 7),
    (0xFD, 8),
    (0x1FFB, 13),
    (0x7FFF0, 19),
    (0x1FFC, 13),
    (0x3FFC, 14),
    (0x22, 6),
    (0x7FFD, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5),
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6),
    (0x27, 6),
    (0x6, 5),
    (0x74, 7),
    (0x75, 7),
    (0x28, 6),
    (0x29, 6),
    (0x2A, 6),
    (0x7, 5),
    (0x2B, 6),
    (0x76, 7),
    (0x2C, 6),
    (0x8, 5),
    (0x9, 5),
    (0x2D, 6),
    (0x77, 7),
    (0x78, 7),
    (0x79, 7),
    (0x7A, 7),
    (0x7B, 7),
    (0x7FFE, 15),
    (0x7FC, 11),
    (0x3FFD, 14),
    (0x1FFD, 13),
    (0xFFFFFFC, 28),
    (0xFFFE6, 20),
    (0x3FFFD2, 22),
    (0xFFFE7, 20),
    (0xFFFE8, 20),
    (0x3FFFD3, 22),
    (0x3FFFD4, 22),
    (0x3FFFD5, 22),
    (0x7FFFD9, 23),
    (0x3FFFD6, 22),
    (0x7FFFDA, 23),
    (0x7FFFDB, 23),
    (0x7FFFDC, 23),
    (0x7FFFDD, 23),
    (0x7FFFDE, 23),
    (0xFFFFEB, 24),
    (0x7FFFDF, 23),
    (0xFFFFEC, 24),
    (0xFFFFED, 24),
    (0x3FFFD7, 22),
    (0x7FFFE0, 23),
    (0xFFFFEE, 24),
    (0x7FFFE1, 23),
    (0x7FFFE2, 23),
    (0x7FFFE3, 23),
    (0x7FFFE4, 23),
    (0x1FFFDC, 21),
    (0x3FFFD8, 22),
    (0x7FFFE5, 23),
    (0x3FFFD9, 22),
    (0x7FFFE6, 23),
    (0x7FFFE7, 23),
    (0xFFFFEF, 24),
    (0x3FFFDA, 22),
    (0x1FFFDD, 21),
    (0xFFFE9, 20),
    (0x3FFFDB, 22),
    (0x3FFFDC, 22),
    (0x7FFFE8, 23),
    (0x7FFFE9, 23),
    (0x1FFFDE, 21),
    (0x7FFFEA, 23),
    (0x3FFFDD, 22),
    (0x3FFFDE, 22),
    (0xFFFFF0, 24),
    (0x1FFFDF, 21),
    (0x3FFFDF, 22),
    (0x7FFFEB, 23),
    (0x7FFFEC, 23),
    (0x1FFFE0, 21),
    (0x1FFFE1, 21),
    (0x3FFFE0, 22),
    (0x1FFFE2, 21),
    (0x7FFFED, 23),
    (0x3FFFE1, 22),
    (0x7FFFEE, 23),
    (0x7FFFEF, 23),
    (0xFFFEA, 20),
    (0x3FFFE2, 22),
    (0x3FFFE3, 22),
    (0x3FFFE4, 22),
    (0x7FFFF0, 23),
    (0x3FFFE5, 22),
    (0x3FFFE6, 22),
    (0x7FFFF1, 23),
    (0x3FFFFE0, 26),
    (0x3FFFFE1, 26),
    (0xFFFEB, 20),
    (0x7FFF1, 19),
    (0x3FFFE7, 22),
    (0x7FFFF2, 23),
    (0x3FFFE8, 22),
    (0x1FFFFEC, 25),
    (0x3FFFFE2, 26),
    (0x3FFFFE3, 26),
    (0x3FFFFE4, 26),
    (0x7FFFFDE, 27),
    (0x7FFFFDF, 27),
    (0x3FFFFE5, 26),
    (0xFFFFF1, 24),
    (0x1FFFFED, 25),
    (0x7FFF2, 19),
    (0x1FFFE3, 21),
    (0x3FFFFE6, 26),
    (0x7FFFFE0, 27),
    (0x7FFFFE1, 27),
    (0x3FFFFE7, 26),
    (0x7FFFFE2, 27),
    (0xFFFFF2, 24),
    (0x1FFFE4, 21),
    (0x1FFFE5, 21),
    (0x3FFFFE8, 26),
    (0x3FFFFE9, 26),
    (0xFFFFFFD, 28),
    (0x7FFFFE3, 27),
    (0x7FFFFE4, 27),
    (0x7FFFFE5, 27),
    (0xFFFEC, 20),
    (0xFFFFF3, 24),
    (0xFFFED, 20),
    (0x1FFFE6, 21),
    (0x3FFFE9, 22),
    (0x1FFFE7, 21),
    (0x1FFFE8, 21),
    (0x7FFFF3, 23),
    (0x3FFFEA, 22),
    (0x3FFFEB, 22),
    (0x1FFFFEE, 25),
    (0x1FFFFEF, 25),
    (0xFFFFF4, 24),
    (0xFFFFF5, 24),
    (0x3FFFFEA, 26),
    (0x7FFFF4, 23),
    (0x3FFFFEB, 26),
    (0x7FFFFE6, 27),
    (0x3FFFFEC, 26),
    (0x3FFFFED, 26),
    (0x7FFFFE7, 27),
    (0x7FFFFE8, 27),
    (0x7FFFFE9, 27),
    (0x7FFFFEA, 27),
    (0x7FFFFEB, 27),
    (0xFFFFFFE, 28),
    (0x7FFFFEC, 27),
    (0x7FFFFED, 27),
    (0x7FFFFEE, 27),
    (0x7FFFFEF, 27),
    (0x7FFFFF0, 27),
    (0x3FFFFEE, 26),
    (0x3FFFFFFF, 30),
)

EOS = 256
# Per-entry overhead of the dynamic table (RFC 7541 4.1).
ENTRY_OVERHEAD = 32
DEFAULT_TABLE_SIZE = 4096
# Integers beyond this are not lengths or indexes any peer means.
MAX_INT = 1 << 32


class HpackError(Exception):
    """A header block that does not decode: a connection error
    (COMPRESSION_ERROR) for HTTP/2."""


def encode_int(value: int, prefix_bits: int, flags: int = 0) -> bytes:
    """value with an N-bit prefix (RFC 7541 5.1); flags fill the bits above
    the prefix in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((flags | value,))
    out = bytearray((flags | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _static_names() -> dict[bytes, int]:
    names: dict[bytes, int] = {}
    for i, (name, _) in enumerate(STATIC_TABLE, 1):
        names.setdefault(name, i)
    return names


def encode(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block of literals without indexing (RFC 7541 6.2.2), the
    name by static index where the static table has it."""
    names = _static_names()
    out = bytearray()
    for name, value in headers:
        index = names.get(name, 0)
        out += encode_int(index, 4)
        if not index:
            out += encode_int(len(name), 7) + name
        out += encode_int(len(value), 7) + value
    return bytes(out)


class Decoder:
    """Decodes the header blocks of one connection, in order (the dynamic
    table carries over from block to block)."""

    def __init__(
        self, max_table_size: int = DEFAULT_TABLE_SIZE, max_header_list_size: int = 1 << 20
    ) -> None:
        # The most the peer may use (our SETTINGS_HEADER_TABLE_SIZE).
        self.max_allowed = max_table_size
        self.max_size = max_table_size
        self.max_header_list_size = max_header_list_size
        self.size = 0
        # Newest last: dynamic index 62 is entries[-1].
        self.entries: list[tuple[bytes, bytes]] = []

    def _add(self, name: bytes, value: bytes) -> None:
        self.entries.append((name, value))
        self.size += len(name) + len(value) + ENTRY_OVERHEAD
        self._evict()

    def _evict(self) -> None:
        drop = 0
        while self.size > self.max_size:
            name, value = self.entries[drop]
            self.size -= len(name) + len(value) + ENTRY_OVERHEAD
            drop += 1
        if drop:
            del self.entries[:drop]

    def _at(self, index: int) -> tuple[bytes, bytes]:
        if index <= 0:
            raise HpackError("index 0")
        if index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        dynamic = index - len(STATIC_TABLE)
        if dynamic > len(self.entries):
            raise HpackError(f"index {index} is beyond the tables")
        return self.entries[-dynamic]

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        total = 0
        pos = 0
        end = len(block)
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed header field
                index, pos = _int(block, pos, 7)
                name, value = self._at(index)
            elif first & 0xE0 == 0x20:  # dynamic table size update
                if headers:
                    raise HpackError("table size update after a header field")
                size, pos = _int(block, pos, 5)
                if size > self.max_allowed:
                    raise HpackError(f"table size {size} over the {self.max_allowed} allowed")
                self.max_size = size
                self._evict()
                continue
            else:
                # 01: incremental indexing (6-bit index); 0000 without
                # indexing and 0001 never indexed (4-bit index).
                indexing = bool(first & 0x40)
                index, pos = _int(block, pos, 6 if indexing else 4)
                if index:
                    name = self._at(index)[0]
                else:
                    name, pos = _string(block, pos)
                value, pos = _string(block, pos)
                if indexing:
                    self._add(name, value)
            total += len(name) + len(value) + ENTRY_OVERHEAD
            if total > self.max_header_list_size:
                raise HpackError("header list too large")
            headers.append((name, value))
        return headers


def _int(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = data[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data):
            raise HpackError("truncated integer")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if value > MAX_INT:
            raise HpackError("integer too large")
        if not byte & 0x80:
            return value, pos
        shift += 7


def _string(data: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(data):
        raise HpackError("truncated string")
    huffman = bool(data[pos] & 0x80)
    length, pos = _int(data, pos, 7)
    if pos + length > len(data):
        raise HpackError("truncated string")
    raw = data[pos : pos + length]
    return (huffman_decode(raw) if huffman else raw), pos + length


# Decoding: (bit length << 32 | code) -> symbol. A constant.
_HUFFMAN_DECODE = {(n << 32) | code: sym for sym, (code, n) in enumerate(HUFFMAN_CODES)}


def huffman_decode(data: bytes) -> bytes:
    table = _HUFFMAN_DECODE
    out = bytearray()
    code = 0
    length = 0
    for byte in data:
        for shift in (7, 6, 5, 4, 3, 2, 1, 0):
            code = (code << 1) | ((byte >> shift) & 1)
            length += 1
            if length < 5:
                continue
            sym = table.get((length << 32) | code)
            if sym is not None:
                if sym == EOS:
                    raise HpackError("EOS in a Huffman-coded string")
                out.append(sym)
                code = 0
                length = 0
            elif length >= 30:
                raise HpackError("invalid Huffman code")
    # At most 7 bits of padding, all ones (the EOS prefix).
    if length > 7 or code != (1 << length) - 1:
        raise HpackError("invalid Huffman padding")
    return bytes(out)


def huffman_encode(data: bytes) -> bytes:
    """RFC 7541 5.2 Huffman coding (for tests and completeness: the encoder
    above does not use it)."""
    acc = 0
    bits = 0
    out = bytearray()
    for sym in data:
        code, n = HUFFMAN_CODES[sym]
        acc = (acc << n) | code
        bits += n
        while bits >= 8:
            bits -= 8
            out.append((acc >> bits) & 0xFF)
        acc &= (1 << bits) - 1
    if bits:
        out.append(((acc << (8 - bits)) | ((1 << (8 - bits)) - 1)) & 0xFF)
    return bytes(out)
