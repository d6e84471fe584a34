"""Build the self-contained flagella-cni bundle (a step of the datapath image).

The container runtime runs a CNI plugin on the node itself, outside any
container, where no flagella venv (and maybe no Python) exists. The bundle
carries what `python -m flagella.cni` needs: this image's Python interpreter
and standard library, what the plugin imports from site-packages (only
flagella.cni itself: it talks to the node's datapath over a unix socket, on
the standard library), and every shared library they load, the C library and
its loader included, so it runs on any x86-64 Linux node whatever its libc.

    python cni_bundle.py OUT

OUT/flagella-cni is the plugin (a /bin/sh shim) and OUT/.flagella-cni its
runtime; install both side by side in the node's CNI bin folder
(docker/datapath/install-cni.sh does).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

# What the plugin imports: the top-level modules that `import flagella.cni`
# loads from site-packages are copied (the flagella namespace).
IMPORTS = "flagella.cni.__main__"
STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "venv",
    "config-3.11-x86_64-linux-gnu",
}
SHIM = """#!/bin/sh
# flagella-cni: the flagella CNI plugin, run on its bundled Python runtime
# (installed beside this file by the flagella datapath's init container).
r="${0%/*}/.flagella-cni"
PYTHONHOME="$r" PYTHONPATH="$r/site" PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 \\
  exec "$r/lib/ld-linux-x86-64.so.2" --library-path "$r/lib" \\
  "$r/bin/python3" -s -m flagella.cni "$@"
"""
LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def shared_libs(path: Path) -> set[Path]:
    """The shared libraries `path` loads, as ldd resolves them."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    return {Path(m.group(1)) for m in LDD_LINE.finditer(out.stdout)}


def site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths["purelib"]), Path(paths["platlib"])]


def imported_from_site() -> list[Path]:
    """Site-packages entries (package folders, single modules) of every
    top-level module that importing the plugin loads."""
    code = (
        f"import sys, {IMPORTS}\n"
        "for m in sorted({n.split('.')[0] for n in sys.modules}): print(m)"
    )
    names = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in names:
        for site in site_dirs():
            for candidate in (site / name, site / f"{name}.py"):
                if candidate.exists() and candidate not in found:
                    found.append(candidate)
    return found


def build(out: Path) -> None:
    runtime = out / ".flagella-cni"
    if runtime.exists():
        shutil.rmtree(runtime)
    (runtime / "bin").mkdir(parents=True)
    (runtime / "lib").mkdir()
    (runtime / "site").mkdir()

    interpreter = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    shutil.copy2(interpreter, runtime / "bin" / "python3")

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dest_stdlib = runtime / "lib" / stdlib.name
    shutil.copytree(
        stdlib,
        dest_stdlib,
        symlinks=False,
        ignore_dangling_symlinks=True,
        ignore=lambda d, names: [n for n in names if Path(d) == stdlib and n in STDLIB_SKIP],
    )

    for src in imported_from_site():
        dest = runtime / "site" / src.name
        if dest.exists():
            continue
        if src.is_dir():
            shutil.copytree(src, dest, symlinks=False)
        else:
            shutil.copy2(src, dest)

    # Every ELF object in the bundle, and what it loads, transitively.
    elves = [runtime / "bin" / "python3", *runtime.rglob("*.so"), *runtime.rglob("*.so.*")]
    seen: set[Path] = set()
    todo = [p for e in elves for p in shared_libs(e)]
    while todo:
        lib = todo.pop()
        if lib in seen:
            continue
        seen.add(lib)
        todo.extend(shared_libs(lib) - seen)
    for lib in seen:
        name = "ld-linux-x86-64.so.2" if lib.name.startswith("ld-linux") else lib.name
        shutil.copy2(os.path.realpath(lib), runtime / "lib" / name)

    shim = out / "flagella-cni"
    shim.write_text(SHIM)
    shim.chmod(0o755)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build(out)
    # The bundle must answer VERSION on its own, with no venv in sight.
    env = {"CNI_COMMAND": "VERSION", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [str(out / "flagella-cni")],
        input=b'{"cniVersion":"1.1.0"}',
        capture_output=True,
        env=env,
        check=False,
    )
    if result.returncode != 0 or b"supportedVersions" not in result.stdout:
        print(result.stdout.decode(), result.stderr.decode(), file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"flagella-cni bundle: {out} ({size // 2**20} MiB): {result.stdout.decode()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
