"""Flow events from the ring buffer, decoded to the fields of
flagella.datapath.v1.Flow."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flagella.datapath.bpf import layout as L

ADDR_CACHE = 4096
_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


@dataclass(frozen=True, slots=True)
class Flow:
    """One event; field names as flagella.datapath.v1.Flow."""

    time_ns: int  # wall clock (Unix epoch, ns)
    type: L.FlowType
    verdict: L.FlowVerdict
    drop_reason: int  # a DropReason number, 0 when forwarded
    direction: L.Direction
    src_ip: str
    dst_ip: str
    src_port: int  # ICMP echo: the identifier on one side, 0 on the other
    dst_port: int
    protocol: int
    src_identity: int
    dst_identity: int
    endpoint_id: int
    ifindex: int
    tcp_flags: int = 0  # TCP: the header's flags byte (FIN 0x01 .. CWR 0x80)
    icmp_type: int = 0  # ICMP / ICMPv6


_SADDR = L.FlowEvent.saddr.offset
_DADDR = L.FlowEvent.daddr.offset


def decode_event(
    raw: bytes, mono_to_wall_ns: int, addr: Callable[[bytes], str] = L.bytes_ip
) -> Flow:
    """addr: 16 address bytes to text (EventReader's shares the strings)."""
    ev = L.FlowEvent.from_buffer_copy(raw[: ctypes.sizeof(L.FlowEvent)])
    return Flow(
        time_ns=ev.ts + mono_to_wall_ns,
        type=L.FlowType(ev.type) if ev.type in (1, 2, 3, 4) else L.FlowType.UNSPECIFIED,
        verdict=L.FlowVerdict(ev.verdict) if ev.verdict in (1, 2, 4) else L.FlowVerdict.UNSPECIFIED,
        drop_reason=ev.reason,
        direction=L.Direction(ev.direction) if ev.direction in (1, 2) else L.Direction.UNSPECIFIED,
        src_ip=addr(raw[_SADDR : _SADDR + 16]),
        dst_ip=addr(raw[_DADDR : _DADDR + 16]),
        src_port=L.port_host(ev.sport),
        dst_port=L.port_host(ev.dport),
        protocol=ev.proto,
        src_identity=ev.src_identity,
        dst_identity=ev.dst_identity,
        endpoint_id=ev.ep_id,
        ifindex=ev.ifindex,
        tcp_flags=ev.tcp_flags,
        icmp_type=ev.icmp_type,
    )


class EventReader:
    """Consumes the events ring buffer (libbpf's ring_buffer). Use poll()
    in a thread, or register fileno() with an event loop and call read()
    when it is readable. One consumer per ring buffer at a time."""

    def __init__(self, map_fd: int) -> None:
        self._lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
        self._lib.ring_buffer__new.restype = ctypes.c_void_p
        self._lib.ring_buffer__new.argtypes = [
            ctypes.c_int,
            _SAMPLE_FN,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self._lib.ring_buffer__poll.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._lib.ring_buffer__consume.argtypes = [ctypes.c_void_p]
        self._lib.ring_buffer__epoll_fd.argtypes = [ctypes.c_void_p]
        self._lib.ring_buffer__free.argtypes = [ctypes.c_void_p]
        self._pending: list[Flow] = []
        # Address bytes -> text: a node's flows name few addresses, so the
        # strings are shared by the records the flow ring keeps (and decoded
        # once). Bounded: emptied when it reaches ADDR_CACHE.
        self._addrs: dict[bytes, str] = {}
        self._offset = time.time_ns() - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self._cb = _SAMPLE_FN(self._on_sample)  # keep a reference
        rb = self._lib.ring_buffer__new(map_fd, self._cb, None, None)
        if not rb:
            raise OSError(ctypes.get_errno(), "ring_buffer__new failed")
        self._rb: int | None = rb

    def _on_sample(self, _ctx: int | None, data: int | None, size: int) -> int:
        if data is not None and size >= ctypes.sizeof(L.FlowEvent):
            self._pending.append(
                decode_event(ctypes.string_at(data, size), self._offset, self._addr)
            )
        return 0

    def _addr(self, raw: bytes) -> str:
        text = self._addrs.get(raw)
        if text is None:
            if len(self._addrs) >= ADDR_CACHE:
                self._addrs.clear()
            text = self._addrs[raw] = L.bytes_ip(raw)
        return text

    def fileno(self) -> int:
        if self._rb is None:
            raise ValueError("event reader closed")
        return int(self._lib.ring_buffer__epoll_fd(self._rb))

    def poll(self, timeout_ms: int = 100) -> list[Flow]:
        """Waits up to timeout_ms for events; returns those available."""
        if self._rb is None:
            raise ValueError("event reader closed")
        ret = self._lib.ring_buffer__poll(self._rb, timeout_ms)
        if ret < 0 and -ret != 4:  # EINTR
            raise OSError(-ret, "ring_buffer__poll failed")
        return self._take()

    def read(self) -> list[Flow]:
        """The events available now, without waiting."""
        if self._rb is None:
            raise ValueError("event reader closed")
        self._lib.ring_buffer__consume(self._rb)
        return self._take()

    def _take(self) -> list[Flow]:
        out, self._pending = self._pending, []
        return out

    def __iter__(self) -> Iterator[Flow]:
        """Forever: every event, as it comes."""
        while self._rb is not None:
            yield from self.poll(200)

    def close(self) -> None:
        if self._rb is not None:
            self._lib.ring_buffer__free(self._rb)
            self._rb = None

    def __enter__(self) -> EventReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
