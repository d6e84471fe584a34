"""A cache of compiled programs, so a datapath (re)start does not pay bcc's
compile (seconds of CPU) when nothing it compiles from changed.

An entry is keyed by everything the bytecode depends on: the bpf/ sources,
layout.py (compile checks the C layouts against it), the compiler's own
relocation format, the bcc version and the running kernel. It is only read
from a folder and file this user owns that nobody else can write: loading
bytecode from a place another user controls would let them choose what
runs in the kernel (the verifier checks safety, not intent).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

from flagella.datapath.bpf import compiler, layout
from flagella.datapath.bpf.compiler import Program, Programs

log = logging.getLogger(__name__)

FORMAT = 1
KEEP = 8  # entries kept (several source trees may share a folder)


def cache_key(source_dir: Path) -> str:
    import bcc

    h = hashlib.sha256(f"{FORMAT}\0{os.uname().release}\0{bcc.__version__}\0".encode())
    for path in sorted(source_dir.glob("*.[ch]")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for module in (layout, compiler):
        h.update(Path(module.__file__ or "").read_bytes())
    return h.hexdigest()[:40]


def _private(path: Path, kind: int) -> bool:
    """path is a kind (S_IFDIR/S_IFREG) this user owns, not writable by others."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return (
        stat.S_IFMT(st.st_mode) == kind
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _encode(programs: Programs) -> bytes:
    return json.dumps(
        {
            name: {
                "code": base64.b64encode(p.code).decode(),
                "relocations": [list(r) for r in p.relocations],
            }
            for name, p in programs.programs.items()
        }
    ).encode()


def _decode(raw: bytes, source_dir: Path) -> Programs:
    doc = json.loads(raw)
    progs = {
        name: Program(
            name=name,
            code=base64.b64decode(p["code"]),
            relocations=tuple((int(i), str(m)) for i, m in p["relocations"]),
        )
        for name, p in doc.items()
    }
    if set(progs) != set(compiler.PROGRAMS):
        raise ValueError(f"holds {sorted(progs)}")
    return Programs(programs=progs, source_dir=source_dir, compile_seconds=0.0, cached=True)


def load_programs(cache_dir: str | os.PathLike[str] | None = None) -> Programs:
    """The compiled datapath: from cache_dir when it holds this source's
    programs, else compiled (and stored there). cache_dir None or "": no
    cache. A cache that cannot be used is logged and compiled around."""
    source_dir = compiler.find_source_dir()
    if not cache_dir:
        return compiler.compile_programs(source_dir)
    folder = Path(cache_dir)
    entry = folder / f"programs-{cache_key(source_dir)}.json"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("BPF program cache not usable", extra={"reason": str(exc)})
        return compiler.compile_programs(source_dir)
    if not _private(folder, stat.S_IFDIR):
        log.warning(
            "BPF program cache not used: its folder is not private to this user",
            extra={"folder": str(folder)},
        )
        return compiler.compile_programs(source_dir)
    if _private(entry, stat.S_IFREG):
        try:
            programs = _decode(entry.read_bytes(), source_dir)
            log.info("BPF programs read from the cache", extra={"entry": str(entry)})
            return programs
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "BPF program cache entry unreadable, compiling",
                extra={"entry": str(entry), "reason": str(exc)},
            )
    programs = compiler.compile_programs(source_dir)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".programs-")
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(programs))
        os.replace(tmp, entry)
    except OSError as exc:
        log.warning("BPF program cache not written", extra={"reason": str(exc)})
    _prune(folder)
    return programs


def _prune(folder: Path) -> None:
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    entries = sorted(folder.glob("programs-*.json"), key=mtime, reverse=True)
    for old in entries[KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()
