"""The cache of compiled BPF programs (flagella.datapath.bpf.progcache): a
restart reads what an earlier start compiled from the same sources, a
change of any source compiles again, and nothing is read from a place
another user could write. Compilation itself is replaced by a counter
here; the real compile is exercised by every privileged test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from flagella.datapath.bpf import compiler, progcache
from flagella.datapath.bpf.compiler import Program, Programs


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "bpf"
    shutil.copytree(compiler.find_source_dir(), src)
    monkeypatch.setenv("FLAGELLA_BPF_DIR", str(src))
    return src


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []

    def fake_compile(source_dir: Path | None = None) -> Programs:
        assert source_dir is not None
        calls.append(source_dir)
        text = (source_dir / "datapath.c").read_bytes()
        progs = {
            name: Program(name, text[:64] + bytes([i]) * 16, ((i, "config"),))
            for i, name in enumerate(compiler.PROGRAMS)
        }
        return Programs(progs, source_dir, 1.0)

    monkeypatch.setattr(compiler, "compile_programs", fake_compile)
    return calls


def test_a_restart_reads_the_programs_an_earlier_start_compiled(
    sources: Path, compiles: list[Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = progcache.load_programs(cache)
    assert (len(compiles), first.cached) == (1, False)
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    second = progcache.load_programs(cache)
    assert (len(compiles), second.cached) == (1, True)
    assert second.programs == first.programs
    # Any source changes: compiled again, and both versions stay cached.
    (sources / "layout.h").write_text((sources / "layout.h").read_text() + "\n/* changed */\n")
    third = progcache.load_programs(cache)
    assert (len(compiles), third.cached) == (2, False)
    assert len(list(cache.glob("programs-*.json"))) == 2
    # No cache folder: compiled every time.
    progcache.load_programs("")
    assert len(compiles) == 3


def test_a_cache_others_can_write_is_not_read_and_a_bad_entry_is_replaced(
    sources: Path, compiles: list[Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    progcache.load_programs(cache)
    [entry] = cache.glob("programs-*.json")
    entry.chmod(0o666)  # another user could have put bytecode there
    assert not progcache.load_programs(cache).cached
    assert len(compiles) == 2
    entry.chmod(0o600)
    cache.chmod(0o777)
    assert not progcache.load_programs(cache).cached
    cache.chmod(0o700)
    entry.write_text("{not json")
    entry.chmod(0o600)
    again = progcache.load_programs(cache)
    assert not again.cached
    assert progcache.load_programs(cache).cached  # rewritten whole
    assert len(compiles) == 4
    # A symlink in place of the entry is not followed.
    target = tmp_path / "elsewhere.json"
    entry.rename(target)
    os.symlink(target, entry)
    assert not progcache.load_programs(cache).cached
