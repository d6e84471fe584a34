"""Synthetic Ethernet frames for BPF_PROG_TEST_RUN, and a parser that
verifies checksums in Python (independently of the kernel's helpers)."""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_ARP = 0x0806

TCP_FIN = 0x01
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_PSH = 0x08
TCP_ACK = 0x10

_POD_MAC = bytes.fromhex("0a0000000001")
_GW_MAC = bytes.fromhex("0a00000000fe")


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of data."""
    if len(data) % 2:
        data += b"\x00"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def _pseudo(src: bytes, dst: bytes, proto: int, length: int) -> bytes:
    if len(src) == 4:
        return src + dst + struct.pack("!BBH", 0, proto, length)
    return src + dst + struct.pack("!IxxxB", length, proto)


def _l4(
    proto: int,
    src: bytes,
    dst: bytes,
    sport: int,
    dport: int,
    *,
    payload: bytes,
    flags: int,
    icmp_type: int,
    icmp_id: int,
) -> bytes:
    if proto == 6:
        hdr = struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, flags, 65535, 0, 0)
        seg = hdr + payload
        c = checksum(_pseudo(src, dst, proto, len(seg)) + seg)
        return seg[:16] + struct.pack("!H", c) + seg[18:]
    if proto == 17:
        seg = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
        c = checksum(_pseudo(src, dst, proto, len(seg)) + seg) or 0xFFFF
        return seg[:6] + struct.pack("!H", c) + seg[8:]
    if proto in (1, 58):
        seg = struct.pack("!BBHHH", icmp_type, 0, 0, icmp_id, 1) + payload
        pseudo = _pseudo(src, dst, proto, len(seg)) if proto == 58 else b""
        c = checksum(pseudo + seg)
        return seg[:2] + struct.pack("!H", c) + seg[4:]
    return struct.pack("!HH", sport, dport) + payload


def build(
    src: str,
    dst: str,
    proto: int = 6,
    sport: int = 40000,
    dport: int = 80,
    *,
    flags: int = TCP_SYN,
    payload: bytes = b"flagella",
    icmp_type: int = 8,
    icmp_id: int = 0x1234,
    src_mac: bytes = _POD_MAC,
    dst_mac: bytes = _GW_MAC,
    ttl: int = 64,
    frag_off: int = 0,
) -> bytes:
    """An Ethernet frame: IPv4 or IPv6 (by the addresses) carrying TCP, UDP,
    ICMP/ICMPv6 (echo by default) or raw ports, with correct checksums."""
    s = ipaddress.ip_address(src)
    d = ipaddress.ip_address(dst)
    l4 = _l4(
        proto,
        s.packed,
        d.packed,
        sport,
        dport,
        payload=payload,
        flags=flags,
        icmp_type=icmp_type,
        icmp_id=icmp_id,
    )
    if s.version == 4:
        hdr = struct.pack(
            "!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, frag_off, ttl, proto, 0, s.packed, d.packed
        )
        hdr = hdr[:10] + struct.pack("!H", checksum(hdr)) + hdr[12:]
        return dst_mac + src_mac + struct.pack("!H", ETH_P_IP) + hdr + l4
    hdr = struct.pack("!IHBB16s16s", 6 << 28, len(l4), proto, ttl, s.packed, d.packed)
    return dst_mac + src_mac + struct.pack("!H", ETH_P_IPV6) + hdr + l4


@dataclass(frozen=True)
class Parsed:
    dst_mac: bytes
    src_mac: bytes
    src: str
    dst: str
    proto: int
    sport: int  # ICMP: the echo identifier
    dport: int  # ICMP: the type
    ttl: int
    l3_csum_ok: bool  # always True for IPv6
    l4_csum_ok: bool
    payload: bytes


def parse(frame: bytes) -> Parsed:
    """Decodes a frame built by build() (or rewritten by the datapath) and
    recomputes its checksums."""
    dst_mac, src_mac = frame[:6], frame[6:12]
    (ethertype,) = struct.unpack_from("!H", frame, 12)
    if ethertype == ETH_P_IP:
        ihl = (frame[14] & 0xF) * 4
        ip = frame[14 : 14 + ihl]
        (total,) = struct.unpack_from("!H", ip, 2)
        ttl, proto = ip[8], ip[9]
        s, d = ip[12:16], ip[16:20]
        l3_ok = checksum(ip) == 0
        seg = frame[14 + ihl : 14 + total]
    elif ethertype == ETH_P_IPV6:
        (plen,) = struct.unpack_from("!H", frame, 18)
        proto, ttl = frame[20], frame[21]
        s, d = frame[22:38], frame[38:54]
        l3_ok = True
        seg = frame[54 : 54 + plen]
    else:
        raise ValueError(f"not IP: ethertype {ethertype:#x}")
    if proto == 6:
        sport, dport = struct.unpack_from("!HH", seg)
        l4_ok = checksum(_pseudo(s, d, proto, len(seg)) + seg) == 0
        payload = seg[20:]
    elif proto == 17:
        sport, dport, _, c = struct.unpack_from("!HHHH", seg)
        l4_ok = c == 0 or checksum(_pseudo(s, d, proto, len(seg)) + seg) == 0
        payload = seg[8:]
    elif proto in (1, 58):
        icmp_type = seg[0]
        (ident,) = struct.unpack_from("!H", seg, 4)
        sport, dport = ident, icmp_type
        if proto == 1:
            l4_ok = checksum(seg) == 0
        else:
            l4_ok = checksum(_pseudo(s, d, proto, len(seg)) + seg) == 0
        payload = seg[8:]
    else:
        sport, dport = struct.unpack_from("!HH", seg)
        l4_ok = True
        payload = seg[4:]
    return Parsed(
        dst_mac=dst_mac,
        src_mac=src_mac,
        src=str(ipaddress.ip_address(s)),
        dst=str(ipaddress.ip_address(d)),
        proto=proto,
        sport=sport,
        dport=dport,
        ttl=ttl,
        l3_csum_ok=l3_ok,
        l4_csum_ok=l4_ok,
        payload=payload,
    )
