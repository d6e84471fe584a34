"""docs/grpcurl.md is executed: every grpcurl command in it runs, in order,
against a running suite (the five services as processes, the datapath as
root in a pin folder of its own), and prints what the doc says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import tls
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from harness.suite import five_services

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
    with five_services(spawn, etcd, tmp_path, "cookbook-dp") as suite:
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
            **{svc.upper(): proc.address for svc, proc in suite.items()},
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
