"""flagella-cni run as a container runtime runs it: environment, config on
stdin, a spec result or error object on stdout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.net import free_port

pytestmark = pytest.mark.integration

PLUGIN = shutil.which("flagella-cni", path=str(Path(sys.executable).parent)) or "flagella-cni"


def run_plugin(
    env: dict[str, str], conf: dict[str, object] | bytes
) -> tuple[int, dict[str, object]]:
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    proc = subprocess.run(
        [PLUGIN],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
        env={"PATH": os.environ.get("PATH", ""), **env},
    )
    out = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, out


def test_version() -> None:
    rc, out = run_plugin({"CNI_COMMAND": "VERSION"}, {"cniVersion": "1.1.0"})
    assert rc == 0
    assert out["cniVersion"] == "1.1.0"
    assert set(out["supportedVersions"]) >= {"0.4.0", "1.0.0", "1.1.0"}  # type: ignore[arg-type]


def test_endpoint_service_down_is_try_again_later() -> None:
    conf = {
        "cniVersion": "1.0.0",
        "name": "n",
        "type": "flagella-cni",
        "endpoint": f"127.0.0.1:{free_port()}",
        "timeout": 5,
    }
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/proc/self/ns/net",
        "CNI_IFNAME": "eth0",
    }
    rc, out = run_plugin(env, conf)
    assert rc != 0
    assert out["code"] == 11
    assert out["cniVersion"] == "1.0.0"
    assert "try again later" in str(out["msg"])
    rc, out = run_plugin({**env, "CNI_COMMAND": "DEL"}, conf)
    assert rc != 0
    assert out["code"] == 11


def test_bad_input_gets_spec_error_objects() -> None:
    rc, out = run_plugin(
        {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"},
        {"cniVersion": "1.1.0", "name": "n", "type": "flagella-cni"},
    )
    assert rc != 0
    assert out["code"] == 4
    assert out["msg"] == "CNI_NETNS not set (required for ADD)"
    rc, out = run_plugin({"CNI_COMMAND": "ADD"}, b"{{{")
    assert (rc != 0, out["code"]) == (True, 6)
    rc, out = run_plugin({"CNI_COMMAND": "ADD"}, {"cniVersion": "0.1.0", "name": "n", "type": "t"})
    assert (rc != 0, out["code"]) == (True, 1)
