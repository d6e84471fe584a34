"""flagella-cni started as the node bundle's shim starts it (Python without
site, the plugin's main given with -c: docker/datapath/cni_bundle.py): it
loads only the standard library's start-up modules and its own, and still
answers every failure with the spec's error object. The node's socket is
served here by a canned answerer, so each of the datapath's kinds of answer
is covered without a datapath (test_cni_plugin.py has the real relay)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import flagella.cni

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOT = Path(flagella.cni.__file__).parents[2]
# What Python loads at start without site, then the plugin's own modules:
# nothing else (no os, re, json, runpy, grpc, nor the utf-8-sig codec).
ALLOWED = {
    "_abc", "_codecs", "_frozen_importlib_external", "_io", "_signal", "_socket", "abc",
    "codecs", "encodings", "encodings.aliases", "encodings.utf_8", "io", "marshal", "posix",
    "time", "zipimport", "__future__", "flagella", "flagella.cni", "flagella.cni.__main__",
    "flagella.cni.cnijson",
}  # fmt: skip


def bundle_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cni_bundle", ROOT / "docker" / "datapath" / "cni_bundle.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_lean(
    env: dict[str, str], stdin: bytes, *, importtime: bool = False
) -> tuple[int, dict[str, object], list[str]]:
    """(exit status, parsed stdout, modules imported) of the plugin run with
    the shim's options and code, on this tree's sources."""
    builder = bundle_builder()
    options = [*builder.PLUGIN_OPTIONS, *(["-X", "importtime"] if importtime else [])]
    proc = subprocess.run(
        [sys.executable, *options, "-c", builder.PLUGIN_CODE],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
        env={"PYTHONPATH": str(SOURCE_ROOT), "PYTHONDONTWRITEBYTECODE": "1", **env},
    )
    modules = [
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.decode().splitlines()
        if line.startswith("import time:") and "imported package" not in line
    ]
    out = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, out, modules


@pytest.fixture
def answerer() -> Iterator[tuple[str, list[bytes], list[bytes]]]:
    """A unix socket that reads one request line per connection and writes
    the next canned answer (cut short when it has no newline). Yields
    (path, answers to give, requests seen)."""
    folder = tempfile.mkdtemp(prefix="flcni-")
    path = f"{folder}/cni.sock"
    answers: list[bytes] = []
    seen: list[bytes] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                seen.append(data)
                conn.sendall(answers.pop(0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path, answers, seen
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(10)
        os.unlink(path)
        os.rmdir(folder)


CONF = {"cniVersion": "1.0.0", "name": "flagella", "type": "flagella-cni"}
ADD = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/proc/self/ns/net",
    "CNI_IFNAME": "eth0",
}


def test_lean_start_imports_nothing_more() -> None:
    rc, out, modules = run_lean(
        {"CNI_COMMAND": "VERSION"}, json.dumps(CONF).encode(), importtime=True
    )
    assert rc == 0
    versions = out["supportedVersions"]
    assert isinstance(versions, list)
    assert "1.1.0" in versions
    assert "flagella.cni.__main__" in modules
    assert set(modules) - ALLOWED == set()


def test_lean_start_gives_spec_errors(
    answerer: tuple[str, list[bytes], list[bytes]],
) -> None:
    path, answers, seen = answerer
    conf = json.dumps({**CONF, "socket": path}).encode()
    missing = json.dumps({**CONF, "socket": f"{path}.absent"}).encode()
    cases: list[tuple[dict[str, str], bytes, int]] = [
        (ADD, b"{not json", 6),
        (ADD, b"[1]", 6),
        ({"CNI_COMMAND": "VERSION"}, b"{}", 7),
        ({"CNI_COMMAND": "VERSION"}, json.dumps({"cniVersion": "9.9.9"}).encode(), 1),
        (ADD, json.dumps({**CONF, "socket": "relative.sock"}).encode(), 7),
        (ADD, missing, 11),
        ({"CNI_COMMAND": "STATUS"}, missing, 50),
    ]
    for env, stdin, code in cases:
        rc, out, _ = run_lean(env, stdin)
        assert (rc, out.get("code")) == (1, code), (env, stdin, out)
        assert isinstance(out.get("msg"), str)
    # The datapath's answers: its error (retry or not), a bad answer, none.
    for answer, code in (
        (b'{"error": "endpoint unreachable", "details": "d", "retry": true}\n', 11),
        (b'{"error": "refused", "details": "d", "retry": false}\n', 100),
        (b"[]\n", 100),
        (b"{\n", 100),
        (b'{"exit": 0', 11),
    ):
        answers.append(answer)
        rc, out, _ = run_lean(ADD, conf)
        assert (rc, out.get("code")) == (1, code), (answer, out)
    # A result is printed as the endpoint service wrote it, with its status;
    # the request carries the CNI variables and the config, BOM dropped.
    answers.append(b'{"exit": 0, "stdout": "{\\"cniVersion\\": \\"1.0.0\\"}"}\n')
    bom_conf = b"\xef\xbb\xbf" + conf
    rc, out, _ = run_lean({**ADD, "CNI_ARGS": "K8S_POD_NAME=p\u00e9"}, bom_conf)
    assert (rc, out) == (0, {"cniVersion": "1.0.0"})
    request = json.loads(seen[-1])
    assert request["command"] == "ADD"
    assert request["container_id"] == "c1"
    assert request["args"] == "K8S_POD_NAME=p\u00e9"
    assert request["config"] == conf.decode()
