"""The bpf(2) system call through ctypes: maps, programs, pins, test runs.

bcc compiles; everything after that (creating and pinning maps with their
real sizes, loading the programs against them, map access) goes through
this thin layer so the loader controls every map and can check a reused
pinned map against the layout it expects.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from dataclasses import dataclass
from functools import cache
from typing import Any

SYS_BPF = 321  # x86_64

# commands
MAP_CREATE = 0
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
MAP_DELETE_ELEM = 3
MAP_GET_NEXT_KEY = 4
PROG_LOAD = 5
OBJ_PIN = 6
OBJ_GET = 7
PROG_TEST_RUN = 10
PROG_GET_FD_BY_ID = 13
MAP_GET_FD_BY_ID = 14
OBJ_GET_INFO_BY_FD = 15
MAP_LOOKUP_BATCH = 24
MAP_UPDATE_BATCH = 26
MAP_DELETE_BATCH = 27

# map types
MAP_TYPE_HASH = 1
MAP_TYPE_ARRAY = 2
MAP_TYPE_PERCPU_ARRAY = 6
MAP_TYPE_LRU_HASH = 9
MAP_TYPE_LPM_TRIE = 11
MAP_TYPE_HASH_OF_MAPS = 13
MAP_TYPE_RINGBUF = 27

MAP_TYPE_NAMES = {
    MAP_TYPE_HASH: "hash",
    MAP_TYPE_ARRAY: "array",
    MAP_TYPE_PERCPU_ARRAY: "percpu_array",
    MAP_TYPE_LRU_HASH: "lru_hash",
    MAP_TYPE_LPM_TRIE: "lpm_trie",
    MAP_TYPE_HASH_OF_MAPS: "hash_of_maps",
    MAP_TYPE_RINGBUF: "ringbuf",
}

PROG_TYPE_SCHED_CLS = 3
PROG_TYPE_XDP = 6
# An XDP program that copes with multi-buffer packets (it reads the first).
F_XDP_HAS_FRAGS = 1 << 5

# flags
F_NO_PREALLOC = 1
F_INNER_MAP = 1 << 12  # an inner map template: inner maps may differ in max_entries
ANY = 0
NOEXIST = 1
EXIST = 2

OBJ_NAME_LEN = 16


class BpfError(OSError):
    """A bpf(2) call failed; errno and the command are kept."""

    def __init__(self, err: int, what: str, log: str = "") -> None:
        super().__init__(err, f"{what}: {os.strerror(err)}" + (f"\n{log}" if log else ""))
        self.log = log


class _MapCreateAttr(ctypes.Structure):
    _fields_ = [
        ("map_type", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("numa_node", ctypes.c_uint32),
        ("map_name", ctypes.c_char * OBJ_NAME_LEN),
    ]


class _MapElemAttr(ctypes.Structure):
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class _MapBatchAttr(ctypes.Structure):
    _fields_ = [
        ("in_batch", ctypes.c_uint64),
        ("out_batch", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("values", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("map_fd", ctypes.c_uint32),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * OBJ_NAME_LEN),
    ]


class _ObjAttr(ctypes.Structure):
    _fields_ = [
        ("pathname", ctypes.c_uint64),
        ("bpf_fd", ctypes.c_uint32),
        ("file_flags", ctypes.c_uint32),
    ]


class _TestRunAttr(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("data_in", ctypes.c_uint64),
        ("data_out", ctypes.c_uint64),
        ("repeat", ctypes.c_uint32),
        ("duration", ctypes.c_uint32),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_uint64),
        ("ctx_out", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


class _GetIdAttr(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint32),
        ("next_id", ctypes.c_uint32),
        ("open_flags", ctypes.c_uint32),
    ]


class _InfoAttr(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


class _MapInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * OBJ_NAME_LEN),
    ]


class _ProgInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * OBJ_NAME_LEN),
    ]


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _call(cmd: int, attr: ctypes.Structure, what: str) -> int:
    libc = _libc()
    ret = int(
        libc.syscall(
            ctypes.c_long(SYS_BPF),
            ctypes.c_int(cmd),
            ctypes.byref(attr),
            ctypes.c_uint(ctypes.sizeof(attr)),
        )
    )
    if ret < 0:
        raise BpfError(ctypes.get_errno(), what)
    return ret


def _addr(obj: ctypes._CData | None) -> int:
    return 0 if obj is None else ctypes.addressof(obj)


def map_create(
    map_type: int,
    key_size: int,
    value_size: int,
    max_entries: int,
    *,
    flags: int,
    name: str,
    inner_map_fd: int = 0,
) -> int:
    """A new map; a map-in-map needs the fd of its inner map template."""
    attr = _MapCreateAttr(
        map_type=map_type,
        key_size=key_size,
        value_size=value_size,
        max_entries=max_entries,
        map_flags=flags,
        inner_map_fd=inner_map_fd,
        map_name=name.encode()[: OBJ_NAME_LEN - 1],
    )
    return _call(MAP_CREATE, attr, f"create map {name}")


def map_lookup(fd: int, key: ctypes._CData, value: ctypes._CData) -> bool:
    attr = _MapElemAttr(map_fd=fd, key=_addr(key), value=_addr(value))
    try:
        _call(MAP_LOOKUP_ELEM, attr, "lookup")
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_update(fd: int, key: ctypes._CData, value: ctypes._CData, flags: int = ANY) -> None:
    attr = _MapElemAttr(map_fd=fd, key=_addr(key), value=_addr(value), flags=flags)
    _call(MAP_UPDATE_ELEM, attr, "update")


def map_delete(fd: int, key: ctypes._CData) -> bool:
    attr = _MapElemAttr(map_fd=fd, key=_addr(key))
    try:
        _call(MAP_DELETE_ELEM, attr, "delete")
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_next_key(fd: int, key: ctypes._CData | None, next_key: ctypes._CData) -> bool:
    attr = _MapElemAttr(map_fd=fd, key=_addr(key), value=_addr(next_key))
    try:
        _call(MAP_GET_NEXT_KEY, attr, "get next key")
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_update_batch(
    fd: int, keys: ctypes.Array[Any], values: ctypes.Array[Any], count: int
) -> int:
    attr = _MapBatchAttr(map_fd=fd, keys=_addr(keys), values=_addr(values), count=count)
    try:
        _call(MAP_UPDATE_BATCH, attr, "update batch")
    except BpfError:
        if attr.count:
            return int(attr.count)
        raise
    return int(attr.count)


def map_delete_batch(fd: int, keys: ctypes.Array[Any], count: int) -> int:
    attr = _MapBatchAttr(map_fd=fd, keys=_addr(keys), count=count)
    _call(MAP_DELETE_BATCH, attr, "delete batch")
    return int(attr.count)


def map_lookup_batch(
    fd: int,
    in_batch: ctypes._CData | None,
    out_batch: ctypes._CData,
    keys: ctypes.Array[Any],
    values: ctypes.Array[Any],
    *,
    count: int,
) -> tuple[int, bool]:
    """(entries read, more to come)."""
    attr = _MapBatchAttr(
        in_batch=_addr(in_batch),
        out_batch=_addr(out_batch),
        keys=_addr(keys),
        values=_addr(values),
        count=count,
        map_fd=fd,
    )
    try:
        _call(MAP_LOOKUP_BATCH, attr, "lookup batch")
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return int(attr.count), False
        raise
    return int(attr.count), True


def prog_load(name: str, insns: bytes, prog_type: int = PROG_TYPE_SCHED_CLS, flags: int = 0) -> int:
    buf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(b"GPL")
    attr = _ProgLoadAttr(
        prog_type=prog_type,
        insn_cnt=len(insns) // 8,
        insns=_addr(buf),
        license=_addr(lic),
        prog_flags=flags,
        prog_name=name.encode()[: OBJ_NAME_LEN - 1],
    )
    try:
        return _call(PROG_LOAD, attr, f"load program {name}")
    except BpfError as e:
        # Again with the verifier's log, for the error message.
        size = 1 << 24
        log = ctypes.create_string_buffer(size)
        attr.log_level = 1
        attr.log_size = size
        attr.log_buf = _addr(log)
        try:
            return _call(PROG_LOAD, attr, f"load program {name}")
        except BpfError:
            text = log.value.decode(errors="replace")
            raise BpfError(e.errno or errno.EINVAL, f"load program {name}", text[-4000:]) from None


def obj_pin(fd: int, path: str) -> None:
    p = ctypes.create_string_buffer(path.encode())
    _call(OBJ_PIN, _ObjAttr(pathname=_addr(p), bpf_fd=fd), f"pin {path}")


def obj_get(path: str) -> int:
    p = ctypes.create_string_buffer(path.encode())
    return _call(OBJ_GET, _ObjAttr(pathname=_addr(p)), f"open pinned {path}")


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def map_info(fd: int) -> MapInfo:
    info = _MapInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_addr(info))
    _call(OBJ_GET_INFO_BY_FD, attr, "map info")
    return MapInfo(
        type=info.type,
        id=info.id,
        key_size=info.key_size,
        value_size=info.value_size,
        max_entries=info.max_entries,
        flags=info.map_flags,
        name=info.name.decode(errors="replace"),
    )


def prog_id(fd: int) -> int:
    info = _ProgInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_addr(info))
    _call(OBJ_GET_INFO_BY_FD, attr, "program info")
    return int(info.id)


def prog_name(fd: int) -> str:
    info = _ProgInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_addr(info))
    _call(OBJ_GET_INFO_BY_FD, attr, "program info")
    return bytes(info.name).decode(errors="replace")


def prog_fd_by_id(prog: int) -> int:
    return _call(PROG_GET_FD_BY_ID, _GetIdAttr(id=prog), f"program {prog}")


def map_fd_by_id(map_id: int) -> int:
    """A descriptor of a map by id (an inner map of a map-in-map)."""
    return _call(MAP_GET_FD_BY_ID, _GetIdAttr(id=map_id), f"map {map_id}")


@dataclass(frozen=True)
class TestRunResult:
    retval: int
    data: bytes
    duration_ns: int


def skb_ctx(*, ifindex: int = 0, ingress_ifindex: int = 0, mark: int = 0) -> bytes:
    """A struct __sk_buff prefix for a test run: the fields the kernel lets
    a test set (ifindex makes the run happen on that device of the
    caller's netns)."""
    fields = [0] * 11  # len .. ifindex
    fields[2] = mark
    fields[9] = ingress_ifindex
    fields[10] = ifindex
    return struct.pack("<11I", *fields)


def prog_test_run(fd: int, data: bytes, repeat: int = 1, ctx: bytes | None = None) -> TestRunResult:
    """BPF_PROG_TEST_RUN: run the program on a copy of data; the kernel
    returns the (possibly rewritten) packet and the mean run time."""
    din = ctypes.create_string_buffer(data, len(data))
    out_size = len(data) + 256
    dout = ctypes.create_string_buffer(out_size)
    attr = _TestRunAttr(
        prog_fd=fd,
        data_size_in=len(data),
        data_size_out=out_size,
        data_in=_addr(din),
        data_out=_addr(dout),
        repeat=repeat,
    )
    cbuf = None
    if ctx is not None:
        cbuf = ctypes.create_string_buffer(ctx, len(ctx))
        attr.ctx_in = _addr(cbuf)
        attr.ctx_size_in = len(ctx)
    _call(PROG_TEST_RUN, attr, "test run")
    return TestRunResult(
        retval=int(attr.retval),
        data=dout.raw[: attr.data_size_out],
        duration_ns=int(attr.duration),
    )


@cache
def possible_cpus() -> int:
    """Number of possible CPUs (per-CPU map values hold one slot each)."""
    with open("/sys/devices/system/cpu/possible") as f:
        text = f.read().strip()
    n = 0
    for part in text.split(","):
        if "-" in part:
            hi = part.split("-")[1]
            n = max(n, int(hi) + 1)
        else:
            n = max(n, int(part) + 1)
    return n


def close(fd: int) -> None:
    os.close(fd)
