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

The runtime starts the plugin once per CNI operation, so the shim starts
Python lean: -S (no site: the plugin needs no .pth file, no sitecustomize,
and its module path comes from PYTHONPATH) and -c rather than -m (runpy
imports importlib.util, contextlib, collections, functools); the plugin's
modules are compiled into the bundle, as PYTHONDONTWRITEBYTECODE keeps
the plugin from writing any. Together 10-12 ms of CPU of 28-31 per operation
(docs/BENCHMARKS.md, "Faster CNI ADD").
"""

from __future__ import annotations

import compileall
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

# What the plugin imports: the modules of the flagella namespace it loads
# are copied (everything else it imports is the standard library).
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
# What the shim has Python run: the plugin's main, without runpy.
PLUGIN_CODE = "import sys; from flagella.cni.__main__ import main; sys.exit(main())"
# Python's options for the plugin: no site (nor user site), no bytecode written.
PLUGIN_OPTIONS = ("-S", "-s")
SHIM = f"""#!/bin/sh
# flagella-cni: the flagella CNI plugin, run on its bundled Python runtime
# (installed beside this file by the flagella datapath's init container).
r="${{0%/*}}/.flagella-cni"
PYTHONHOME="$r" PYTHONPATH="$r/site" PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 \\
  exec "$r/lib/ld-linux-x86-64.so.2" --library-path "$r/lib" \\
  "$r/bin/python3" {" ".join(PLUGIN_OPTIONS)} -c '{PLUGIN_CODE}' "$@"
"""
LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def shared_libs(path: Path) -> set[Path]:
    """The shared libraries `path` loads, as ldd resolves them."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    return {Path(m.group(1)) for m in LDD_LINE.finditer(out.stdout)}


def plugin_modules() -> list[tuple[Path, Path]]:
    """(file, path under the bundle's site folder) of every module of the
    flagella namespace that importing the plugin loads, wherever it is
    installed (site-packages, or the source tree of an editable install).
    The plugin imports nothing else outside the standard library."""
    code = (
        f"import sys, {IMPORTS}\n"
        "for name, module in sorted(sys.modules.items()):\n"
        "    if name.startswith('flagella.') and getattr(module, '__file__', None):\n"
        "        print(name, module.__file__)"
    )
    lines = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    found = []
    for line in lines:
        name, file = line.split(" ", 1)
        parts = name.split(".")
        source = Path(file)
        if source.name == "__init__.py":
            found.append((source, Path(*parts, "__init__.py")))
        else:
            found.append((source, Path(*parts[:-1], source.name)))
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

    for source, relative in plugin_modules():
        dest = runtime / "site" / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest)
    # The plugin writes no bytecode (PYTHONDONTWRITEBYTECODE): without it
    # compiled here, every run would compile its modules again.
    compileall.compile_dir(runtime / "site", quiet=1)

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
