"""docs/grpcurl.md is executed: every grpcurl command in it runs, in order,
against a running suite (the five services as processes, the datapath as
root in a pin folder of its own), and prints what the doc says it prints."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import tls
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess

from flagella.common import pki

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpcurl.md"


def examples() -> list[tuple[str, str]]:
    """(command, expected substring) of every grpcurl line in the doc's sh
    blocks; the expectation is the "# → ..." line that follows, if any."""
    out: list[tuple[str, str]] = []
    for block in re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("grpcurl "):
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                out.append((line, nxt[len("# → ") :] if nxt.startswith("# → ") else ""))
    return out


def grpcurl_flags(folder: Path) -> str:
    return f"-cacert {folder}/ca.crt -cert {folder}/tls.crt -key {folder}/tls.key"


def test_the_cookbook_runs_as_written(
    require_root: None, etcd: EtcdServer, spawn: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    common = ("--etcd-endpoints", etcd.endpoint)
    ipam = spawn("ipam", *common, "--cluster-cidr", "10.244.0.0/16")
    policy = spawn("policy", *common)
    lb = spawn("lb", *common)
    endpoint = spawn(
        "endpoint", *common, "--ipam-address", ipam.address, "--policy-address", policy.address
    )
    pins = f"/sys/fs/bpf/fl-cookbook-{uuid.uuid4().hex[:6]}"
    try:
        datapath = spawn(
            "datapath",
            "--bpf-root",
            pins,
            "--state-dir",
            str(tmp_path / "dp"),
            "--no-enable-ip-forward",
            "--node-name",
            "cookbook-dp",
        )
        env = {
            **os.environ,
            # The doc's $OPERATOR, $AS_ENDPOINT, $AS_NODE: grpcurl's TLS flags.
            **{
                var: grpcurl_flags(tls.session().bundle(identity))
                for var, identity in (
                    ("OPERATOR", tls.OPERATOR),
                    ("AS_ENDPOINT", pki.service("endpoint")),
                    ("AS_NODE", pki.node("cookbook-node")),
                )
            },
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "IPAM": ipam.address,
            "POLICY": policy.address,
            "ENDPOINT": endpoint.address,
            "LB": lb.address,
            "DATAPATH": datapath.address,
        }
        cases = examples()
        assert len(cases) >= 25
        for command, expected in cases:
            proc = subprocess.run(
                ["bash", "-c", command],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert proc.returncode == 0, f"{command}\n{proc.stderr}"
            assert expected in proc.stdout, f"{command}\nwanted {expected!r} in:\n{proc.stdout}"
    finally:
        shutil.rmtree(pins, ignore_errors=True)
