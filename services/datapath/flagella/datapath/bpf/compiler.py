"""Compile bpf/ once with bcc into relocatable bytecode.

bcc compiles the C against placeholder maps; we keep the instructions of
each program and remember which instruction loads which map. Loading then
points those instructions at the real (pinned) maps, so one compile serves
any pin folder and map size, and maps are created only by the loader.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flagella.datapath.bpf import layout, prefilter, syscall

PROGRAMS = (
    "from_container",
    "to_container",
    "from_netdev",
    "to_netdev",
    "from_tunnel",
    "to_tunnel",
    prefilter.PROGRAM,
    "to_proxy",
)
# Programs that are not tc classifiers: their BPF program type and load
# flags. The prefilter reads only the headers, in a packet's first buffer:
# it takes multi-buffer packets, so a veth keeps GSO and large MTUs with it.
PROGRAM_TYPES = {prefilter.PROGRAM: (syscall.PROG_TYPE_XDP, syscall.F_XDP_HAS_FRAGS)}

_LD_IMM64 = 0x18
_PSEUDO_MAP_FD = 1


class CompileError(RuntimeError):
    pass


@dataclass(frozen=True)
class Program:
    name: str
    code: bytes  # instructions, map loads zeroed
    relocations: tuple[tuple[int, str], ...]  # (instruction index, map name)

    def instantiate(self, map_fds: Mapping[str, int]) -> bytes:
        code = bytearray(self.code)
        for index, name in self.relocations:
            struct.pack_into("<i", code, index * 8 + 4, map_fds[name])
        return bytes(code)


@dataclass(frozen=True)
class Programs:
    """The compiled datapath: every program, relocatable."""

    programs: Mapping[str, Program]
    source_dir: Path
    compile_seconds: float
    cached: bool = False  # read from the program cache (progcache), not compiled

    def __getitem__(self, name: str) -> Program:
        return self.programs[name]


def find_source_dir() -> Path:
    """bpf/ of the source tree: $FLAGELLA_BPF_DIR, else the nearest bpf/
    holding datapath.c above this file (the editable install)."""
    env = os.environ.get("FLAGELLA_BPF_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "bpf" / "datapath.c"
        if candidate.is_file():
            return candidate.parent
    raise CompileError("bpf/datapath.c not found: set FLAGELLA_BPF_DIR")


def compile_programs(source_dir: Path | None = None) -> Programs:
    """Compile bpf/datapath.c with bcc (about a second). Also checks that
    the compiled map layouts equal flagella.datapath.bpf.layout."""
    from bcc import BPF, libbcc

    src = source_dir or find_source_dir()
    started = time.monotonic()
    try:
        b = BPF(
            src_file=str(src / "datapath.c").encode(),
            cflags=[f"-I{src}", "-Wno-unused-function"],
        )
    except Exception as e:  # bcc raises bare Exception on compile errors
        raise CompileError(f"bcc failed to compile {src / 'datapath.c'}: {e}") from e
    try:
        specs = {
            spec.name: spec
            for spec in (*layout.map_specs(layout.MapSizes()), *prefilter.map_specs())
        }
        fd_names: dict[int, str] = {}
        for name, spec in specs.items():
            fd = int(libbcc.lib.bpf_table_fd(b.module, name.encode()))
            if fd < 0:
                raise CompileError(f"map {name} is not declared in datapath.c")
            fd_names[fd] = name
            if spec.key is not None:
                _check_layout(b, name, spec)
        _check_layout(
            b,
            "event_layout",
            layout.MapSpec("event_layout", 0, layout.U32, layout.FlowEvent, 1, 0, None, None),
        )
        progs = {}
        for name in PROGRAMS:
            raw = bytes(b.dump_func(name.encode()))
            progs[name] = _relocatable(name, raw, fd_names)
    finally:
        b.cleanup()
    return Programs(programs=progs, source_dir=src, compile_seconds=time.monotonic() - started)


def _relocatable(name: str, raw: bytes, fd_names: Mapping[int, str]) -> Program:
    code = bytearray(raw)
    relocs = []
    i = 0
    n = len(code) // 8
    while i < n:
        op, regs, _off, imm = struct.unpack_from("<BBhi", code, i * 8)
        if op == _LD_IMM64:
            if regs >> 4 == _PSEUDO_MAP_FD:
                if imm not in fd_names:
                    raise CompileError(f"{name}: instruction {i} loads an unknown map (fd {imm})")
                relocs.append((i, fd_names[imm]))
                struct.pack_into("<i", code, i * 8 + 4, 0)
            elif regs >> 4 != 0:
                raise CompileError(f"{name}: unsupported 64-bit load kind {regs >> 4}")
            i += 2
            continue
        i += 1
    return Program(name=name, code=bytes(code), relocations=tuple(relocs))


def _check_layout(b: object, name: str, spec: layout.MapSpec) -> None:
    table = b[name.encode()]  # type: ignore[index]
    for what, ours, theirs in (
        ("key", spec.key, table.Key),
        ("value", spec.value, getattr(table, "sLeaf", table.Leaf)),
    ):
        assert ours is not None
        if ctypes.sizeof(ours) != ctypes.sizeof(theirs):
            raise CompileError(
                f"map {name}: {what} is {ctypes.sizeof(theirs)} bytes in C, "
                f"{ctypes.sizeof(ours)} in layout.py"
            )
        c_fields = {f[0]: getattr(theirs, f[0]).offset for f in getattr(theirs, "_fields_", ())}
        for f in ours._fields_:
            fname = f[0]
            if fname in c_fields and c_fields[fname] != getattr(ours, fname).offset:
                raise CompileError(
                    f"map {name}: {what} field {fname} at offset {c_fields[fname]} in C, "
                    f"{getattr(ours, fname).offset} in layout.py"
                )
